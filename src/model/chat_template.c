/*
 * Chat templates: the Jinja subset of Hugging Face chat templates, rendered
 * byte-for-byte as @huggingface/jinja renders them (include/pdserve/
 * chat_template.h states the contract, docs/model.md the subset).
 *
 * Three stages, top to bottom in this file:
 *
 *   1. preprocess + lex: the reference's textual preprocessing (one trailing
 *      newline dropped, lstrip_blocks, trim_blocks) and its tokenizer,
 *      including the whitespace control of {%- -%} {{- -}} {#- -#}. A map
 *      from each preprocessed byte back to the source keeps error positions
 *      in the author's lines and columns.
 *   2. parse: recursive descent to an AST, with the reference's operator
 *      precedence. Everything outside the subset (an unknown tag, filter,
 *      test, function or method) is refused here, naming the construct, so a
 *      template that compiles only meets run-time errors that depend on data.
 *   3. evaluate: a tree walk over values allocated from a per-render arena.
 *
 * Errors unwind with longjmp, as in Lua's parser and VM: every allocation of
 * a compile or a render lives in one arena owned by the caller of setjmp (or
 * in the output buffer it also owns), so unwinding leaks nothing and the
 * hundreds of places that can fail need no error plumbing. setjmp is called
 * in exactly two functions, pd_chat_template_compile and _render, around
 * compile_guarded and render_guarded; nothing between them and a longjmp
 * holds a resource of its own.
 *
 * Bounds: source size, the syntax tree's depth (the parser counts nesting
 * and chain links, so the evaluator's recursion is bounded too), arena bytes
 * and output bytes together (PD_CHAT_TEMPLATE_MEMORY_MAX), evaluation steps
 * (STEPS_MAX) and the context's nesting (DATA_DEPTH_MAX).
 */
#include "pdserve/chat_template.h"

#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define STEPS_MAX 20000000u
#define DATA_DEPTH_MAX 128u
#define ARENA_CHUNK_BYTES (64u << 10)

/* ---- arena ------------------------------------------------------------------------ */

typedef struct chunk {
    struct chunk *next;
    size_t used, cap;
} chunk;

#define CHUNK_HEADER ((sizeof(chunk) + 15u) & ~(size_t)15u)

typedef struct arena {
    chunk *head;
    size_t bytes; /* allocated from malloc, headers included */
} arena;

/* NULL when the allocation would take the arena (with extra_bytes, the
 * caller's other memory) past PD_CHAT_TEMPLATE_MEMORY_MAX. */
static void *arena_alloc(arena *a, size_t n, size_t extra_bytes) {
    n = (n + 15u) & ~(size_t)15u;
    if (n > PD_CHAT_TEMPLATE_MEMORY_MAX) return NULL;
    if (!a->head || a->head->cap - a->head->used < n) {
        size_t cap = PD_MAX(n, (size_t)ARENA_CHUNK_BYTES);
        if (a->bytes + extra_bytes + cap + CHUNK_HEADER > PD_CHAT_TEMPLATE_MEMORY_MAX) return NULL;
        chunk *c = malloc(CHUNK_HEADER + cap);
        if (!c) return NULL;
        *c = (chunk){.next = a->head, .used = 0, .cap = cap};
        a->head = c;
        a->bytes += CHUNK_HEADER + cap;
    }
    void *p = (char *)a->head + CHUNK_HEADER + a->head->used;
    a->head->used += n;
    PD_ASSERT(a->head->used <= a->head->cap);
    return p;
}

static void arena_free(arena *a) {
    for (chunk *c = a->head, *next; c; c = next) {
        next = c->next;
        free(c);
    }
    a->head = NULL;
    a->bytes = 0;
}

/* ---- values ----------------------------------------------------------------------- */

typedef enum vkind {
    V_UNDEF,
    V_NONE,
    V_BOOL,
    V_INT,
    V_FLOAT,
    V_STR,
    V_LIST,
    V_DICT,
    V_NS,
    V_FUNC
} vkind;

typedef struct list list;
typedef struct dict dict;

typedef struct val {
    vkind k;
    union {
        bool b;
        int64_t i;
        double f;
        struct {
            const char *s;
            size_t n;
        } str;
        list *l;
        dict *d; /* V_DICT and V_NS */
    } u;
} val;

struct list {
    val *v;
    size_t n, cap;
};

struct dict {
    const char **key;
    size_t *key_len;
    val *v;
    size_t n, cap;
};

static const val UNDEF = {.k = V_UNDEF};
static const val NONE = {.k = V_NONE};

static val v_bool(bool b) { return (val){.k = V_BOOL, .u.b = b}; }
static val v_int(int64_t i) { return (val){.k = V_INT, .u.i = i}; }
static val v_float(double f) { return (val){.k = V_FLOAT, .u.f = f}; }
static val v_str(const char *s, size_t n) { return (val){.k = V_STR, .u.str = {s, n}}; }

/* ---- AST ------------------------------------------------------------------------------ */

typedef enum nkind {
    N_TEXT,
    N_BREAK,
    N_CONTINUE,
    N_OUT,
    N_IF,
    N_FOR,
    N_SET, /* statements */
    N_STR,
    N_INT,
    N_FLOAT,
    N_NAME,
    N_LIST,
    N_DICT,
    N_ATTR,
    N_INDEX,
    N_SLICE,
    N_CALL,
    N_FILTER,
    N_TEST,
    N_BIN,
    N_NOT,
    N_NEG,
    N_POS,
    N_COND,
    N_KWARG,
    N_TUPLE
} nkind;

typedef enum binop {
    OP_OR,
    OP_AND,
    OP_EQ,
    OP_NE,
    OP_LT,
    OP_GT,
    OP_LE,
    OP_GE,
    OP_IN,
    OP_NOTIN,
    OP_ADD,
    OP_SUB,
    OP_CAT,
    OP_MUL,
    OP_DIV,
    OP_FLOORDIV,
    OP_MOD
} binop;

typedef struct node node;
struct node {
    nkind kind;
    binop op;
    bool negate; /* N_TEST: `is not` */
    uint32_t line, col;
    const char *s; /* text, string literal, name, attribute, filter, test, kwarg */
    size_t n;
    int64_t i;
    double f;
    node *a, *b, *c; /* operands; N_SLICE: start, stop, step (NULL when absent) */
    node **kid;      /* body, items, arguments; N_DICT: key, value, key, value... */
    size_t nkid;
    node **alt; /* else body */
    size_t nalt;
};

struct pd_chat_template {
    arena ar;
    node **body;
    size_t nbody;
};

/* ---- failing ---------------------------------------------------------------------- */

typedef struct failer {
    jmp_buf jb;
    char *msg;
    size_t msg_cap;
    pd_err err;
} failer;

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static _Noreturn void
fail(failer *f, pd_err err, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    if (f->msg && f->msg_cap) vsnprintf(f->msg, f->msg_cap, fmt, ap);
    va_end(ap);
    f->err = err;
    longjmp(f->jb, 1);
}

static _Noreturn void vfail_at(failer *f, pd_err err, uint32_t line, uint32_t col, const char *fmt,
                               va_list ap) {
    if (f->msg && f->msg_cap) {
        int k = col ? snprintf(f->msg, f->msg_cap, "chat template line %u col %u: ", line, col)
            : line  ? snprintf(f->msg, f->msg_cap, "chat template line %u: ", line)
                    : snprintf(f->msg, f->msg_cap, "chat template: ");
        if (k >= 0 && (size_t)k < f->msg_cap)
            vsnprintf(f->msg + k, f->msg_cap - (size_t)k, fmt, ap);
    }
    f->err = err;
    longjmp(f->jb, 1);
}

/* ---- JavaScript's whitespace (the reference trims with /\s/ and String.trim) ---- */

/* Bytes of the whitespace character at s[i] (UTF-8), or 0. */
static size_t js_space_at(const char *s, size_t n, size_t i) {
    const unsigned char *u = (const unsigned char *)s + i;
    size_t left = n - i;
    if (i >= n) return 0;
    if (u[0] == ' ' || (u[0] >= 9 && u[0] <= 13)) return 1;
    if (left >= 2 && u[0] == 0xC2 && u[1] == 0xA0) return 2;
    if (left < 3) return 0;
    uint32_t c = ((uint32_t)u[0] << 16) | ((uint32_t)u[1] << 8) | u[2];
    bool space = c == 0xE19A80 || (c >= 0xE28080 && c <= 0xE2808A) || c == 0xE280A8 ||
        c == 0xE280A9 || c == 0xE280AF || c == 0xE2819F || c == 0xE38080 || c == 0xEFBBBF;
    return space ? 3 : 0;
}

/* Bytes of the whitespace character ending at s[end - 1], or 0. */
static size_t js_space_before(const char *s, size_t end) {
    for (size_t k = 1; k <= 3 && k <= end; k++)
        if (js_space_at(s, end, end - k) == k) return k;
    return 0;
}

static size_t js_trim_start(const char *s, size_t n, size_t i) {
    for (size_t k; i < n && (k = js_space_at(s, n, i)) > 0;) i += k;
    return i;
}

static size_t js_trim_end(const char *s, size_t n) {
    for (size_t k; n > 0 && (k = js_space_before(s, n)) > 0;) n -= k;
    return n;
}

/* ---- compile context, preprocessing ---------------------------------------------- */

typedef enum tkind {
    T_TEXT,
    T_COMMENT,
    T_OPEN_STMT,
    T_CLOSE_STMT,
    T_OPEN_EXPR,
    T_CLOSE_EXPR,
    T_NUM,
    T_STR,
    T_NAME,
    T_PUNCT
} tkind;

typedef struct token {
    tkind k;
    const char *s;
    size_t n;
    size_t off; /* in the preprocessed text */
} token;

typedef struct cc {
    failer f;
    arena *ar;
    const char *src;
    size_t src_len;
    char *pp;      /* the preprocessed text */
    uint32_t *pos; /* pos[i]: the source offset of pp[i] */
    size_t len;
    token *tok;
    size_t ntok, tok_cap;
    size_t at;      /* the parser's cursor into tok */
    unsigned depth; /* the parser's nesting */
    unsigned loops; /* for bodies open around the parser (break, continue) */
    int curly;      /* the lexer's { } depth inside {{ }} */
} cc;

static void *cc_alloc(cc *c, size_t n) {
    void *p = arena_alloc(c->ar, n, 0);
    if (!p) fail(&c->f, PD_ERR_NOMEM, "chat template: out of memory");
    return p;
}

/* Line and column (1-based) of preprocessed offset off, in the source. */
static void cc_where(const cc *c, size_t off, uint32_t *line, uint32_t *col) {
    size_t end = off < c->len ? c->pos[off] : c->src_len;
    *line = 1;
    *col = 1;
    for (size_t i = 0; i < end; i++) {
        if (c->src[i] == '\n') {
            ++*line;
            *col = 1;
        } else if (((unsigned char)c->src[i] & 0xC0) != 0x80) {
            ++*col;
        }
    }
}

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static _Noreturn void
cc_fail(cc *c, size_t off, const char *fmt, ...) {
    uint32_t line, col;
    cc_where(c, off, &line, &col);
    va_list ap;
    va_start(ap, fmt);
    vfail_at(&c->f, PD_ERR_PARSE, line, col, fmt, ap);
}

/* The position of the parser's current token (the end when past the last). */
static size_t cc_off(const cc *c) { return c->at < c->ntok ? c->tok[c->at].off : c->len; }

static bool js_line_start(const char *s, size_t i) {
    if (i == 0 || s[i - 1] == '\n' || s[i - 1] == '\r') return true;
    const unsigned char *u = (const unsigned char *)s;
    return i >= 3 && u[i - 3] == 0xE2 && u[i - 2] == 0x80 && (u[i - 1] == 0xA8 || u[i - 1] == 0xA9);
}

static bool is_tag_mark(char ch) { return ch == '#' || ch == '%' || ch == '-'; }

/* lstrip_blocks, as the reference does it: /^[ \t]*({[#%-])/gm -> "$1". */
static size_t pp_lstrip(const char *s, const uint32_t *pos, size_t n, char *o, uint32_t *opos) {
    size_t m = 0;
    for (size_t i = 0; i < n;) {
        if (js_line_start(s, i)) {
            size_t q = i;
            while (q < n && (s[q] == ' ' || s[q] == '\t')) q++;
            if (q + 1 < n && s[q] == '{' && is_tag_mark(s[q + 1])) {
                o[m] = s[q], opos[m++] = pos[q];
                o[m] = s[q + 1], opos[m++] = pos[q + 1];
                i = q + 2;
                continue;
            }
        }
        o[m] = s[i], opos[m++] = pos[i];
        i++;
    }
    return m;
}

/* trim_blocks: /([#%-]})\n/g -> "$1". */
static size_t pp_trim(const char *s, const uint32_t *pos, size_t n, char *o, uint32_t *opos) {
    size_t m = 0;
    for (size_t i = 0; i < n;) {
        bool hit = i + 2 < n && is_tag_mark(s[i]) && s[i + 1] == '}' && s[i + 2] == '\n';
        o[m] = s[i], opos[m++] = pos[i];
        if (hit) {
            o[m] = s[i + 1], opos[m++] = pos[i + 1];
            i += 3;
        } else {
            i++;
        }
    }
    return m;
}

static void preprocess(cc *c) {
    size_t n = c->src_len;
    if (n > 0 && c->src[n - 1] == '\n') n--;
    char *a = cc_alloc(c, n + 1), *b = cc_alloc(c, n + 1);
    uint32_t *pa = cc_alloc(c, (n + 1) * sizeof(uint32_t));
    uint32_t *pb = cc_alloc(c, (n + 1) * sizeof(uint32_t));
    for (size_t i = 0; i < n; i++) pa[i] = (uint32_t)i;
    size_t m = pp_lstrip(c->src, pa, n, b, pb);
    m = pp_trim(b, pb, m, a, pa);
    PD_ASSERT(m <= n);
    c->pp = a;
    c->pos = pa;
    c->len = m;
}

/* ---- lexer (the reference's tokenize) ------------------------------------------ */

static void push(cc *c, tkind k, const char *s, size_t n, size_t off) {
    if (c->ntok == c->tok_cap) {
        size_t cap = c->tok_cap ? 2 * c->tok_cap : 256;
        token *t = cc_alloc(c, cap * sizeof(token));
        if (c->ntok) memcpy(t, c->tok, c->ntok * sizeof(token));
        c->tok = t;
        c->tok_cap = cap;
    }
    c->tok[c->ntok++] = (token){.k = k, .s = s, .n = n, .off = off};
}

static tkind last_kind(const cc *c) { return c->ntok ? c->tok[c->ntok - 1].k : T_COMMENT; }

/* {%- {{- {#-: the text before loses its trailing whitespace. */
static void strip_last_text(cc *c) {
    if (!c->ntok || c->tok[c->ntok - 1].k != T_TEXT) return;
    token *t = &c->tok[c->ntok - 1];
    t->n = js_trim_end(t->s, t->n);
    if (t->n == 0) c->ntok--;
}

static bool at(const cc *c, size_t i, const char *lit) {
    size_t n = strlen(lit);
    return i + n <= c->len && memcmp(c->pp + i, lit, n) == 0;
}

static size_t lex_comment(cc *c, size_t i) {
    size_t start = i;
    i += 2;
    bool strip_before = i < c->len && c->pp[i] == '-';
    if (strip_before) i++;
    size_t body = i;
    while (!at(c, i, "#}")) {
        if (i + 2 >= c->len) cc_fail(c, start, "unterminated comment (no '#}')");
        i++;
    }
    bool strip_after = i > body && c->pp[i - 1] == '-';
    if (strip_before) strip_last_text(c);
    push(c, T_COMMENT, c->pp + body, i - body, start);
    i += 2;
    return strip_after ? js_trim_start(c->pp, c->len, i) : i;
}

static void utf8_put(char *o, size_t *m, uint32_t cp) {
    if (cp < 0x80) {
        o[(*m)++] = (char)cp;
    } else if (cp < 0x800) {
        o[(*m)++] = (char)(0xC0 | (cp >> 6));
        o[(*m)++] = (char)(0x80 | (cp & 0x3F));
    } else {
        o[(*m)++] = (char)(0xE0 | (cp >> 12));
        o[(*m)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[(*m)++] = (char)(0x80 | (cp & 0x3F));
    }
}

static int hex_digit(char ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

/* One escape after a backslash at pp[*i]; appends its UTF-8 to o. */
static void lex_escape(cc *c, size_t *i, char *o, size_t *m) {
    size_t start = *i;
    if (++*i >= c->len) cc_fail(c, start, "unexpected end of template in a string");
    char e = c->pp[(*i)++];
    if (e == 'x' || e == 'u') {
        unsigned digits = e == 'x' ? 2 : 4;
        uint32_t cp = 0;
        for (unsigned k = 0; k < digits; k++) {
            int d = *i < c->len ? hex_digit(c->pp[*i]) : -1;
            if (d < 0) cc_fail(c, start, "invalid escape sequence \\%c", e);
            cp = cp * 16 + (uint32_t)d;
            ++*i;
        }
        utf8_put(o, m, (cp >= 0xD800 && cp < 0xE000) ? 0xFFFD : cp);
        return;
    }
    static const char from[] = "ntrbfv'\"\\", to[] = "\n\t\r\b\f\v'\"\\";
    const char *hit = e ? strchr(from, e) : NULL;
    if (!hit) cc_fail(c, start, "unexpected escaped character '%c'", e);
    o[(*m)++] = to[hit - from];
}

static size_t lex_string(cc *c, size_t i) {
    size_t start = i;
    char quote = c->pp[i++];
    size_t end = i; /* escapes only shrink: size the copy by the raw extent */
    while (end < c->len && c->pp[end] != quote) end += c->pp[end] == '\\' ? 2 : 1;
    char *o = cc_alloc(c, end - i + 1);
    size_t m = 0;
    while (i < c->len && c->pp[i] != quote) {
        if (c->pp[i] == '\\') {
            lex_escape(c, &i, o, &m);
        } else {
            o[m++] = c->pp[i++];
        }
        if (i >= c->len) cc_fail(c, start, "unterminated string");
    }
    if (i >= c->len) cc_fail(c, start, "unterminated string");
    PD_ASSERT(m <= i - start); /* an escape never grows */
    push(c, T_STR, o, m, start);
    return i + 1;
}

static bool is_digit(char ch) { return ch >= '0' && ch <= '9'; }
static bool is_word(char ch) {
    return is_digit(ch) || ch == '_' || (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z');
}

/* Digits, then a fraction when one follows (and the number is not an
 * attribute: x.0.1 is x[0][1]). start may be a sign. */
static size_t lex_number(cc *c, size_t start, size_t i) {
    while (i < c->len && is_digit(c->pp[i])) i++;
    bool after_dot = c->ntok && c->tok[c->ntok - 1].k == T_PUNCT && c->tok[c->ntok - 1].s[0] == '.';
    if (!after_dot && i + 1 < c->len && c->pp[i] == '.' && is_digit(c->pp[i + 1])) {
        i++;
        while (i < c->len && is_digit(c->pp[i])) i++;
    }
    push(c, T_NUM, c->pp + start, i - start, start);
    return i;
}

static bool sign_is_binary(const cc *c) {
    if (!c->ntok) return false;
    const token *t = &c->tok[c->ntok - 1];
    if (t->k == T_NAME || t->k == T_NUM || t->k == T_STR) return true;
    return t->k == T_PUNCT && (t->s[0] == ')' || t->s[0] == ']');
}

static const char *const PUNCT[] = {"(", ")",  "{",  "}",  "[",  "]", ",", ".", ":",
                                    "|", "<=", ">=", "==", "!=", "<", ">", "+", "-",
                                    "~", "**", "*",  "//", "/",  "%", "="};

static size_t lex_punct(cc *c, size_t i) {
    static const struct {
        const char *s;
        tkind k;
    } TAGS[] = {
        {"{%", T_OPEN_STMT}, {"%}", T_CLOSE_STMT}, {"{{", T_OPEN_EXPR}, {"}}", T_CLOSE_EXPR}};
    for (size_t k = 0; k < PD_ARRAY_LEN(TAGS); k++) {
        if (!at(c, i, TAGS[k].s) || (TAGS[k].k == T_CLOSE_EXPR && c->curly > 0)) continue;
        if (TAGS[k].k == T_OPEN_EXPR) c->curly = 0;
        push(c, TAGS[k].k, c->pp + i, 2, i);
        return i + 2;
    }
    for (size_t k = 0; k < PD_ARRAY_LEN(PUNCT); k++) {
        if (!at(c, i, PUNCT[k])) continue;
        if (PUNCT[k][0] == '{') c->curly++;
        if (PUNCT[k][0] == '}') c->curly--;
        push(c, T_PUNCT, c->pp + i, strlen(PUNCT[k]), i);
        return i + strlen(PUNCT[k]);
    }
    return 0;
}

/* One token inside {% %} or {{ }}, at pp[i] (not whitespace). */
static size_t lex_token(cc *c, size_t i) {
    char ch = c->pp[i];
    if ((ch == '-' || ch == '+') && (last_kind(c) == T_TEXT || !c->ntok))
        cc_fail(c, i, "unexpected character '%c'", ch);
    if ((ch == '-' || ch == '+') && !sign_is_binary(c)) {
        if (i + 1 < c->len && is_digit(c->pp[i + 1])) return lex_number(c, i, i + 1);
        push(c, T_PUNCT, c->pp + i, 1, i);
        return i + 1;
    }
    size_t next = lex_punct(c, i);
    if (next) return next;
    if (ch == '\'' || ch == '"') return lex_string(c, i);
    if (is_digit(ch)) return lex_number(c, i, i);
    if (is_word(ch)) {
        size_t j = i;
        while (j < c->len && is_word(c->pp[j])) j++;
        push(c, T_NAME, c->pp + i, j - i, i);
        return j;
    }
    cc_fail(c, i, "unexpected character '%c'", ch);
}

static size_t lex_text(cc *c, size_t i) {
    size_t j = i;
    while (j < c->len &&
           !(c->pp[j] == '{' && j + 1 < c->len &&
             (c->pp[j + 1] == '%' || c->pp[j + 1] == '{' || c->pp[j + 1] == '#')))
        j++;
    if (j > i) push(c, T_TEXT, c->pp + i, j - i, i);
    return j;
}

static void lex(cc *c) {
    for (size_t i = 0; i < c->len;) {
        PD_ASSERT(c->ntok == 0 || c->tok[c->ntok - 1].off <= i);
        tkind last = last_kind(c);
        if (last == T_CLOSE_STMT || last == T_CLOSE_EXPR || last == T_COMMENT) {
            size_t j = lex_text(c, i);
            if (j > i) {
                i = j;
                continue;
            }
        }
        if (at(c, i, "{#")) {
            i = lex_comment(c, i);
        } else if (at(c, i, "{%-") || at(c, i, "{{-")) {
            strip_last_text(c);
            if (c->pp[i + 1] == '{') c->curly = 0;
            push(c, c->pp[i + 1] == '%' ? T_OPEN_STMT : T_OPEN_EXPR, c->pp + i, 2, i);
            i += 3;
        } else {
            i = js_trim_start(c->pp, c->len, i);
            if (i >= c->len) cc_fail(c, i, "unexpected end of template inside a tag");
            if (at(c, i, "-%}") || at(c, i, "-}}")) {
                push(c, c->pp[i + 1] == '%' ? T_CLOSE_STMT : T_CLOSE_EXPR, c->pp + i + 1, 2, i);
                i = js_trim_start(c->pp, c->len, i + 3);
            } else {
                i = lex_token(c, i);
            }
        }
    }
}

/* ---- parser ----------------------------------------------------------------------- */

static const char *const FILTERS[] = {"trim",  "length",     "tojson",    "string", "default",
                                      "upper", "lower",      "items",     "join",   "first",
                                      "last",  "list",       "reverse",   "safe",   "replace",
                                      "map",   "selectattr", "rejectattr"};
static const char *const TESTS[] = {
    "defined", "undefined", "none",     "string",   "number", "integer", "boolean", "true", "false",
    "mapping", "sequence",  "iterable", "callable", "odd",    "even",    "lower",   "upper"};
static const char *const METHODS[] = {"startswith", "endswith", "split", "strip", "lstrip",
                                      "rstrip",     "replace",  "upper", "lower", "get",
                                      "items",      "keys",     "values"};
static const char *const FUNCTIONS[] = {"raise_exception", "namespace", "range", "strftime_now"};

static bool in_set(const char *const *set, size_t n, const char *s, size_t len) {
    for (size_t k = 0; k < n; k++)
        if (strlen(set[k]) == len && memcmp(set[k], s, len) == 0) return true;
    return false;
}

static const token *peek(const cc *c) { return c->at < c->ntok ? &c->tok[c->at] : NULL; }

static bool tok_is(const token *t, tkind k, const char *s) {
    return t && t->k == k && (!s || (t->n == strlen(s) && memcmp(t->s, s, t->n) == 0));
}
static bool next_is(const cc *c, tkind k, const char *s) { return tok_is(peek(c), k, s); }
static bool next_punct(const cc *c, const char *s) { return next_is(c, T_PUNCT, s); }
static bool next_name(const cc *c, const char *s) { return next_is(c, T_NAME, s); }

static const char *tok_desc(const cc *c) {
    static const char *const KIND[] = {"text", "comment",  "'{%'",     "'%}'",   "'{{'",
                                       "'}}'", "a number", "a string", "a name", "punctuation"};
    const token *t = peek(c);
    return t ? KIND[t->k] : "the end of the template";
}

static const token *expect(cc *c, tkind k, const char *s, const char *what) {
    if (!next_is(c, k, s)) cc_fail(c, cc_off(c), "expected %s, found %s", what, tok_desc(c));
    return &c->tok[c->at++];
}

static node *mk(cc *c, nkind k, size_t off) {
    node *n = cc_alloc(c, sizeof(node));
    *n = (node){.kind = k};
    cc_where(c, off, &n->line, &n->col);
    return n;
}

static void enter(cc *c) {
    if (++c->depth > PD_CHAT_TEMPLATE_DEPTH_MAX)
        cc_fail(c, cc_off(c), "nesting deeper than %u", PD_CHAT_TEMPLATE_DEPTH_MAX);
}

/* A growing array of node pointers in the arena (the old copies stay there). */
static void append(cc *c, node ***arr, size_t *n, size_t *cap, node *x) {
    if (*n == *cap) {
        size_t nc = *cap ? 2 * *cap : 4;
        node **a = cc_alloc(c, nc * sizeof(node *));
        if (*n) memcpy(a, *arr, *n * sizeof(node *));
        *arr = a;
        *cap = nc;
    }
    (*arr)[(*n)++] = x;
}

static node *parse_expr(cc *c);

/* Arguments after '(': positional, then name=value (N_KWARG). */
static void parse_args(cc *c, node *call) {
    size_t cap = 0;
    expect(c, T_PUNCT, "(", "'('");
    while (!next_punct(c, ")")) {
        node *arg;
        if (next_is(c, T_NAME, NULL) && c->at + 1 < c->ntok &&
            tok_is(&c->tok[c->at + 1], T_PUNCT, "=")) {
            arg = mk(c, N_KWARG, cc_off(c));
            arg->s = c->tok[c->at].s;
            arg->n = c->tok[c->at].n;
            c->at += 2;
            arg->a = parse_expr(c);
        } else {
            arg = parse_expr(c);
        }
        append(c, &call->kid, &call->nkid, &cap, arg);
        if (!next_punct(c, ")")) expect(c, T_PUNCT, ",", "',' or ')'");
    }
    c->at++;
}

static node *parse_literal_number(cc *c) {
    const token *t = &c->tok[c->at++];
    char buf[64];
    if (t->n >= sizeof(buf)) cc_fail(c, t->off, "number literal too long");
    memcpy(buf, t->s, t->n);
    buf[t->n] = 0;
    node *n = mk(c, memchr(buf, '.', t->n) ? N_FLOAT : N_INT, t->off);
    if (n->kind == N_FLOAT) {
        n->f = strtod(buf, NULL);
    } else {
        errno = 0;
        long long v = strtoll(buf, NULL, 10);
        if (errno == ERANGE) cc_fail(c, t->off, "integer literal out of range");
        n->i = v;
    }
    return n;
}

static node *parse_string(cc *c) {
    const token *t = &c->tok[c->at++];
    node *n = mk(c, N_STR, t->off);
    size_t total = t->n, k = c->at;
    for (; k < c->ntok && c->tok[k].k == T_STR; k++) total += c->tok[k].n;
    char *s = cc_alloc(c, total + 1);
    memcpy(s, t->s, t->n);
    for (size_t m = t->n; c->at < k; c->at++) {
        memcpy(s + m, c->tok[c->at].s, c->tok[c->at].n);
        m += c->tok[c->at].n;
    }
    n->s = s;
    n->n = total;
    return n;
}

static node *parse_collection(cc *c, bool is_dict) {
    size_t off = cc_off(c), cap = 0;
    node *n = mk(c, is_dict ? N_DICT : N_LIST, off);
    c->at++;
    const char *close = is_dict ? "}" : "]";
    while (!next_punct(c, close)) {
        append(c, &n->kid, &n->nkid, &cap, parse_expr(c));
        if (is_dict) {
            expect(c, T_PUNCT, ":", "':' in a dict literal");
            append(c, &n->kid, &n->nkid, &cap, parse_expr(c));
        }
        if (!next_punct(c, close)) expect(c, T_PUNCT, ",", is_dict ? "',' or '}'" : "',' or ']'");
    }
    c->at++;
    return n;
}

/* (a, b, ...) after its first item: a tuple is a list, as in the reference. */
static node *parse_tuple(cc *c, node *first, size_t off) {
    node *n = mk(c, N_LIST, off);
    size_t cap = 0;
    append(c, &n->kid, &n->nkid, &cap, first);
    while (next_punct(c, ",")) {
        c->at++;
        if (next_punct(c, ")")) break;
        append(c, &n->kid, &n->nkid, &cap, parse_expr(c));
    }
    expect(c, T_PUNCT, ")", "')'");
    return n;
}

static node *parse_primary(cc *c) {
    const token *t = peek(c);
    if (!t) cc_fail(c, c->len, "unexpected end of the template in an expression");
    if (t->k == T_NUM) return parse_literal_number(c);
    if (t->k == T_STR) return parse_string(c);
    if (t->k == T_NAME) {
        node *n = mk(c, N_NAME, t->off);
        n->s = t->s;
        n->n = t->n;
        c->at++;
        return n;
    }
    if (tok_is(t, T_PUNCT, "(")) {
        c->at++;
        node *n = parse_expr(c);
        if (next_punct(c, ",")) return parse_tuple(c, n, t->off);
        expect(c, T_PUNCT, ")", "')'");
        return n;
    }
    if (tok_is(t, T_PUNCT, "[")) return parse_collection(c, false);
    if (tok_is(t, T_PUNCT, "{")) return parse_collection(c, true);
    cc_fail(c, t->off, "unexpected %s in an expression", tok_desc(c));
}

/* After '[': an index, or a slice a:b:c with any part left out. */
static node *parse_subscript(cc *c, node *obj, size_t off) {
    node *part[3] = {NULL, NULL, NULL};
    unsigned colons = 0;
    while (!next_punct(c, "]")) {
        if (next_punct(c, ":")) {
            if (++colons > 2) cc_fail(c, cc_off(c), "a slice has at most three parts");
            c->at++;
            continue;
        }
        if (part[colons]) cc_fail(c, cc_off(c), "expected ':' or ']', found %s", tok_desc(c));
        part[colons] = parse_expr(c);
    }
    c->at++;
    if (colons == 0 && !part[0]) cc_fail(c, off, "empty subscript");
    node *n = mk(c, colons ? N_SLICE : N_INDEX, off);
    n->a = obj;
    if (colons == 0) {
        n->b = part[0];
    } else {
        n->b = part[0], n->c = part[1];
        n->alt = cc_alloc(c, sizeof(node *));
        n->alt[0] = part[2];
        n->nalt = 1;
    }
    return n;
}

/* Only the calls of the subset: the two global functions and the methods. */
static void check_call(cc *c, const node *callee, size_t off) {
    if (callee->kind == N_NAME) {
        if (!in_set(FUNCTIONS, PD_ARRAY_LEN(FUNCTIONS), callee->s, callee->n))
            cc_fail(c, off, "the function '%.*s' is not supported", (int)callee->n, callee->s);
    } else if (callee->kind == N_ATTR) {
        if (!in_set(METHODS, PD_ARRAY_LEN(METHODS), callee->s, callee->n))
            cc_fail(c, off, "the method '%.*s' is not supported", (int)callee->n, callee->s);
    } else {
        cc_fail(c, off, "only functions and methods can be called");
    }
}

/* Each link of a chain (a.b[c](d), x|f|g, a + b + c) deepens the tree the
 * evaluator recurses over without nesting in the parser: it counts towards
 * the depth limit as nesting does, and is given back after the chain. */
static void enter_link(cc *c, unsigned *links) {
    enter(c);
    ++*links;
}

static node *parse_postfix(cc *c) {
    node *n = parse_primary(c);
    unsigned links = 0;
    for (;; enter_link(c, &links)) {
        size_t off = cc_off(c);
        if (next_punct(c, ".")) {
            c->at++;
            const token *t = peek(c);
            if (!t || (t->k != T_NAME && t->k != T_NUM))
                cc_fail(c, off, "expected a name after '.', found %s", tok_desc(c));
            node *m;
            if (t->k == T_NAME) {
                m = mk(c, N_ATTR, off);
                m->s = t->s, m->n = t->n;
                c->at++;
            } else {
                m = mk(c, N_INDEX, off);
                m->b = parse_literal_number(c);
                if (m->b->kind != N_INT) cc_fail(c, off, "expected an integer after '.'");
            }
            m->a = n;
            n = m;
        } else if (next_punct(c, "[")) {
            c->at++;
            n = parse_subscript(c, n, off);
        } else if (next_punct(c, "(")) {
            check_call(c, n, off);
            node *m = mk(c, N_CALL, off);
            m->a = n;
            parse_args(c, m);
            n = m;
        } else {
            c->depth -= links;
            return n;
        }
    }
}

static node *parse_unary(cc *c) {
    if (next_punct(c, "-") || next_punct(c, "+")) {
        node *n = mk(c, next_punct(c, "-") ? N_NEG : N_POS, cc_off(c));
        c->at++;
        enter(c);
        n->a = parse_unary(c);
        c->depth--;
        return n;
    }
    return parse_postfix(c);
}

/* selectattr/rejectattr(attr[, test[, value]]): string literals, as in the
 * reference, and a test of the subset (or equalto/eq, which take the value). */
static void check_select_args(cc *c, const node *m, size_t off) {
    if (m->nkid < 1 || m->nkid > 3)
        cc_fail(c, off, "'%.*s' takes an attribute, a test and a value", (int)m->n, m->s);
    for (size_t i = 0; i < m->nkid; i++)
        if (m->kid[i]->kind != N_STR)
            cc_fail(c, off, "the arguments of '%.*s' must be string literals", (int)m->n, m->s);
    const node *t = m->nkid > 1 ? m->kid[1] : NULL;
    if (t && !in_set(TESTS, PD_ARRAY_LEN(TESTS), t->s, t->n) &&
        !((t->n == 7 && !memcmp(t->s, "equalto", 7)) || (t->n == 2 && !memcmp(t->s, "eq", 2))))
        cc_fail(c, off, "the test '%.*s' is not supported", (int)t->n, t->s);
}

static node *parse_filter(cc *c) {
    node *n = parse_unary(c);
    unsigned links = 0;
    while (next_punct(c, "|")) {
        enter_link(c, &links);
        c->at++;
        const token *t = expect(c, T_NAME, NULL, "a filter name after '|'");
        if (!in_set(FILTERS, PD_ARRAY_LEN(FILTERS), t->s, t->n))
            cc_fail(c, t->off, "the filter '%.*s' is not supported", (int)t->n, t->s);
        node *m = mk(c, N_FILTER, t->off);
        m->a = n, m->s = t->s, m->n = t->n;
        if (next_punct(c, "(")) parse_args(c, m);
        if (tok_is(t, T_NAME, "selectattr") || tok_is(t, T_NAME, "rejectattr"))
            check_select_args(c, m, t->off);
        for (size_t i = 0; tok_is(t, T_NAME, "tojson") && i < m->nkid; i++)
            if (m->kid[i]->kind != N_KWARG || m->kid[i]->n != 6 ||
                memcmp(m->kid[i]->s, "indent", 6) != 0)
                cc_fail(c, t->off, "the filter 'tojson' takes no argument but indent=N");
        n = m;
    }
    c->depth -= links;
    return n;
}

static node *parse_test(cc *c) {
    node *n = parse_filter(c);
    unsigned links = 0;
    while (next_name(c, "is")) {
        enter_link(c, &links);
        c->at++;
        bool negate = next_name(c, "not");
        if (negate) c->at++;
        const token *t = expect(c, T_NAME, NULL, "a test name after 'is'");
        if (!in_set(TESTS, PD_ARRAY_LEN(TESTS), t->s, t->n))
            cc_fail(c, t->off, "the test '%.*s' is not supported", (int)t->n, t->s);
        if (next_punct(c, "("))
            cc_fail(c, t->off, "the test '%.*s' with arguments is not supported", (int)t->n, t->s);
        node *m = mk(c, N_TEST, t->off);
        m->a = n, m->s = t->s, m->n = t->n, m->negate = negate;
        n = m;
    }
    if (next_punct(c, "**")) cc_fail(c, cc_off(c), "the operator '**' is not supported");
    c->depth -= links;
    return n;
}

typedef struct opdef {
    const char *s;
    binop op;
} opdef;

static node *parse_binary_level(cc *c, unsigned level);

/* Binary operators by precedence, loosest first, as the reference parses. */
static const opdef LEVEL_MUL[] = {{"*", OP_MUL}, {"//", OP_FLOORDIV}, {"/", OP_DIV}, {"%", OP_MOD}};
static const opdef LEVEL_ADD[] = {{"+", OP_ADD}, {"-", OP_SUB}, {"~", OP_CAT}};
static const opdef LEVEL_CMP[] = {{"==", OP_EQ}, {"!=", OP_NE}, {"<=", OP_LE},
                                  {">=", OP_GE}, {"<", OP_LT},  {">", OP_GT}};

static bool match_op(cc *c, unsigned level, binop *op) {
    const opdef *set = level == 2 ? LEVEL_CMP : level == 3 ? LEVEL_ADD : LEVEL_MUL;
    size_t n = level == 2 ? PD_ARRAY_LEN(LEVEL_CMP)
        : level == 3      ? PD_ARRAY_LEN(LEVEL_ADD)
                          : PD_ARRAY_LEN(LEVEL_MUL);
    if (level == 0 || level == 1) {
        *op = level == 0 ? OP_OR : OP_AND;
        if (!next_name(c, level == 0 ? "or" : "and")) return false;
        c->at++;
        return true;
    }
    if (level == 2 && next_name(c, "in")) {
        *op = OP_IN;
        c->at++;
        return true;
    }
    if (level == 2 && next_name(c, "not") && c->at + 1 < c->ntok &&
        tok_is(&c->tok[c->at + 1], T_NAME, "in")) {
        *op = OP_NOTIN;
        c->at += 2;
        return true;
    }
    for (size_t k = 0; k < n; k++)
        if (next_punct(c, set[k].s)) {
            *op = set[k].op;
            c->at++;
            return true;
        }
    return false;
}

/* Levels: 0 or, 1 and, 2 comparisons and in, 3 + - ~, 4 * / // %; the
 * operands of `and` may be negated: not a == b is not (a == b). */
static node *parse_operand(cc *c, unsigned level) {
    if (level == 1 && next_name(c, "not")) {
        node *n = mk(c, N_NOT, cc_off(c));
        c->at++;
        enter(c);
        n->a = parse_operand(c, 1);
        c->depth--;
        return n;
    }
    return level == 4 ? parse_test(c) : parse_binary_level(c, level + 1);
}

static node *parse_binary_level(cc *c, unsigned level) {
    node *left = parse_operand(c, level);
    binop op;
    unsigned links = 0;
    for (size_t off = cc_off(c); match_op(c, level, &op); off = cc_off(c)) {
        enter_link(c, &links);
        node *n = mk(c, N_BIN, off);
        n->op = op;
        n->a = left;
        n->b = parse_operand(c, level);
        left = n;
    }
    c->depth -= links;
    return left;
}

static node *parse_expr(cc *c) {
    enter(c);
    node *n = parse_binary_level(c, 0);
    if (next_name(c, "if")) {
        node *m = mk(c, N_COND, cc_off(c));
        c->at++;
        m->a = n;
        m->b = parse_binary_level(c, 0);
        if (!next_name(c, "else"))
            cc_fail(c, cc_off(c), "an inline 'if' without 'else' is not supported");
        c->at++;
        m->c = parse_expr(c);
        n = m;
    }
    c->depth--;
    return n;
}

/* ---- statements ------------------------------------------------------------------- */

static void parse_body(cc *c, node ***body, size_t *n, const char *const *ends, size_t nends,
                       const char *opener);

static const char *const TAGS_REFUSED[] = {
    "macro",      "call", "filter",   "block",   "extends",    "include",
    "import",     "from", "raw",      "with",    "generation", "endgeneration",
    "autoescape", "do",   "endmacro", "endcall", "endfilter",  "endset"};

static void close_tag(cc *c) { expect(c, T_CLOSE_STMT, NULL, "'%}'"); }

/* `{% tag` of the block end the parser stopped at; consumes both tokens. */
static const token *take_tag(cc *c) {
    c->at++;
    return &c->tok[c->at++];
}

static node *parse_if(cc *c, size_t off) {
    static const char *const ENDS[] = {"elif", "else", "endif"};
    node *n = mk(c, N_IF, off);
    enter(c);
    n->a = parse_expr(c);
    close_tag(c);
    parse_body(c, &n->kid, &n->nkid, ENDS, 3, "if");
    const token *t = take_tag(c);
    if (tok_is(t, T_NAME, "elif")) {
        n->alt = cc_alloc(c, sizeof(node *));
        n->alt[0] = parse_if(c, t->off);
        n->nalt = 1;
    } else if (tok_is(t, T_NAME, "else")) {
        close_tag(c);
        parse_body(c, &n->alt, &n->nalt, ENDS + 2, 1, "if");
        take_tag(c);
        close_tag(c);
    } else {
        close_tag(c);
    }
    c->depth--;
    return n;
}

static node *parse_loop_target(cc *c) {
    const token *t = expect(c, T_NAME, NULL, "a loop variable");
    node *n = mk(c, N_NAME, t->off);
    n->s = t->s, n->n = t->n;
    if (!next_punct(c, ",")) return n;
    node *tuple = mk(c, N_TUPLE, t->off);
    size_t cap = 0;
    append(c, &tuple->kid, &tuple->nkid, &cap, n);
    while (next_punct(c, ",")) {
        c->at++;
        t = expect(c, T_NAME, NULL, "a loop variable after ','");
        n = mk(c, N_NAME, t->off);
        n->s = t->s, n->n = t->n;
        append(c, &tuple->kid, &tuple->nkid, &cap, n);
    }
    return tuple;
}

static node *parse_for(cc *c, size_t off) {
    static const char *const ENDS[] = {"else", "endfor"};
    node *n = mk(c, N_FOR, off);
    enter(c);
    n->a = parse_loop_target(c);
    expect(c, T_NAME, "in", "'in'");
    n->b = parse_binary_level(c, 0);
    if (next_name(c, "if")) cc_fail(c, cc_off(c), "a loop filter ('for ... if') is not supported");
    if (next_name(c, "recursive")) cc_fail(c, cc_off(c), "recursive loops are not supported");
    close_tag(c);
    c->loops++;
    parse_body(c, &n->kid, &n->nkid, ENDS, 2, "for");
    c->loops--;
    if (tok_is(take_tag(c), T_NAME, "else")) {
        close_tag(c);
        parse_body(c, &n->alt, &n->nalt, ENDS + 1, 1, "for");
        take_tag(c);
    }
    close_tag(c);
    c->depth--;
    return n;
}

static node *parse_set(cc *c, size_t off) {
    node *n = mk(c, N_SET, off);
    const token *t = expect(c, T_NAME, NULL, "a name after 'set'");
    n->a = mk(c, N_NAME, t->off);
    n->a->s = t->s, n->a->n = t->n;
    if (next_punct(c, ".")) {
        c->at++;
        const token *attr = expect(c, T_NAME, NULL, "an attribute name after '.'");
        node *m = mk(c, N_ATTR, attr->off);
        m->a = n->a, m->s = attr->s, m->n = attr->n;
        n->a = m;
    }
    if (next_punct(c, ",")) cc_fail(c, cc_off(c), "assigning to several names is not supported");
    if (next_is(c, T_CLOSE_STMT, NULL))
        cc_fail(c, cc_off(c), "the block form of 'set' is not supported");
    expect(c, T_PUNCT, "=", "'='");
    n->b = parse_expr(c);
    close_tag(c);
    return n;
}

static node *parse_statement(cc *c) {
    size_t off = cc_off(c);
    c->at++; /* {% */
    const token *t = expect(c, T_NAME, NULL, "a tag name after '{%'");
    if (tok_is(t, T_NAME, "if")) return parse_if(c, off);
    if (tok_is(t, T_NAME, "for")) return parse_for(c, off);
    if (tok_is(t, T_NAME, "set")) return parse_set(c, off);
    if (tok_is(t, T_NAME, "break") || tok_is(t, T_NAME, "continue")) {
        if (c->loops == 0) cc_fail(c, t->off, "'%.*s' outside a loop", (int)t->n, t->s);
        node *n = mk(c, t->s[0] == 'b' ? N_BREAK : N_CONTINUE, off);
        close_tag(c);
        return n;
    }
    if (in_set(TAGS_REFUSED, PD_ARRAY_LEN(TAGS_REFUSED), t->s, t->n) ||
        !(tok_is(t, T_NAME, "elif") || tok_is(t, T_NAME, "else") || tok_is(t, T_NAME, "endif") ||
          tok_is(t, T_NAME, "endfor")))
        cc_fail(c, t->off, "the tag '%.*s' is not supported", (int)t->n, t->s);
    cc_fail(c, t->off, "'%.*s' without its opening tag", (int)t->n, t->s);
}

static node *parse_one(cc *c) {
    const token *t = peek(c);
    if (t->k == T_TEXT) {
        node *n = mk(c, N_TEXT, t->off);
        n->s = t->s, n->n = t->n;
        c->at++;
        return n;
    }
    if (t->k == T_OPEN_EXPR) {
        node *n = mk(c, N_OUT, t->off);
        c->at++;
        n->a = parse_expr(c);
        expect(c, T_CLOSE_EXPR, NULL, "'}}'");
        return n;
    }
    if (t->k == T_OPEN_STMT) return parse_statement(c);
    cc_fail(c, t->off, "unexpected %s", tok_desc(c));
}

/* Statements until `{% end %}` for one of ends (left for the caller), or the
 * end of the template when ends is empty. */
static void parse_body(cc *c, node ***body, size_t *n, const char *const *ends, size_t nends,
                       const char *opener) {
    size_t cap = 0;
    *body = NULL;
    *n = 0;
    for (;;) {
        while (next_is(c, T_COMMENT, NULL)) c->at++;
        const token *t = peek(c);
        if (!t) {
            if (nends)
                cc_fail(c, c->len, "unterminated '%s' (no '{%% %s %%}')", opener, ends[nends - 1]);
            return;
        }
        if (t->k == T_OPEN_STMT && c->at + 1 < c->ntok && c->tok[c->at + 1].k == T_NAME &&
            in_set(ends, nends, c->tok[c->at + 1].s, c->tok[c->at + 1].n))
            return;
        size_t before = c->at;
        append(c, body, n, &cap, parse_one(c));
        PD_ASSERT(c->at > before); /* every statement consumes a token: the loop ends */
    }
}

static void compile_guarded(cc *c, pd_chat_template *t) {
    preprocess(c);
    lex(c);
    parse_body(c, &t->body, &t->nbody, NULL, 0, NULL);
    PD_ASSERT(c->at == c->ntok && c->depth == 0);
}

pd_err pd_chat_template_compile(const char *src, size_t len, pd_chat_template **out, char *msg,
                                size_t msg_cap) {
    PD_ASSERT(out && (src || len == 0));
    *out = NULL;
    if (len > PD_CHAT_TEMPLATE_SOURCE_MAX)
        return pd_errorf(msg, msg_cap, PD_ERR_TOOBIG, "chat template: %zu bytes, limit %u", len,
                         PD_CHAT_TEMPLATE_SOURCE_MAX);
    pd_chat_template *t = calloc(1, sizeof(*t));
    if (!t) return pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "chat template: out of memory");
    cc *c = calloc(1, sizeof(*c));
    if (!c) {
        free(t);
        return pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "chat template: out of memory");
    }
    *c = (cc){.f = {.msg = msg, .msg_cap = msg_cap}, .ar = &t->ar, .src = src, .src_len = len};
    pd_err err = PD_OK;
    if (setjmp(c->f.jb) == 0) {
        compile_guarded(c, t);
    } else {
        err = c->f.err;
    }
    free(c);
    if (err) {
        pd_chat_template_free(t);
        return err;
    }
    *out = t;
    return PD_OK;
}

void pd_chat_template_free(pd_chat_template *t) {
    if (!t) return;
    arena_free(&t->ar);
    free(t);
}

/* ---- runtime: scopes, memory, output ------------------------------------------ */

typedef struct binding {
    struct binding *next;
    const char *name;
    size_t n;
    val v;
} binding;

typedef struct scope {
    struct scope *parent;
    binding *head;
} scope;

typedef struct rt {
    failer f;
    arena ar;
    char *out;
    size_t out_len, out_cap;
    scope *sc;
    uint64_t steps;
    nkind ctl; /* N_BREAK or N_CONTINUE while one unwinds to its loop, else N_TEXT */
} rt;

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static _Noreturn void
rfail(rt *r, const node *at, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfail_at(&r->f, PD_ERR_INVALID, at ? at->line : 0, 0, fmt, ap);
}

static void *ralloc(rt *r, size_t n) {
    void *p = arena_alloc(&r->ar, n, r->out_cap);
    if (!p)
        fail(&r->f, PD_ERR_TOOBIG, "chat template: rendering needs more than %zu MiB",
             PD_CHAT_TEMPLATE_MEMORY_MAX >> 20);
    return p;
}

static void step(rt *r, const node *at) {
    if (++r->steps > STEPS_MAX)
        fail(&r->f, PD_ERR_TOOBIG, "chat template line %u: more than %u evaluation steps", at->line,
             STEPS_MAX);
}

static void out_append(rt *r, const char *s, size_t n) {
    if (n > r->out_cap - r->out_len) {
        size_t cap = PD_MAX(r->out_cap * 2, r->out_len + n + 1);
        if (cap + r->ar.bytes > PD_CHAT_TEMPLATE_MEMORY_MAX)
            fail(&r->f, PD_ERR_TOOBIG, "chat template: output larger than %zu MiB",
                 PD_CHAT_TEMPLATE_MEMORY_MAX >> 20);
        char *p = realloc(r->out, cap);
        if (!p) fail(&r->f, PD_ERR_NOMEM, "chat template: out of memory");
        r->out = p;
        r->out_cap = cap;
    }
    if (n) memcpy(r->out + r->out_len, s, n);
    r->out_len += n;
    PD_ASSERT(r->out_len <= r->out_cap);
}

/* A string being built in the arena (tojson, join, concatenation). */
typedef struct sbuf {
    char *s;
    size_t n, cap;
} sbuf;

static void sb_put(rt *r, sbuf *b, const char *s, size_t n) {
    if (n > b->cap - b->n) {
        size_t cap = PD_MAX(b->cap * 2, b->n + n + 16);
        char *p = ralloc(r, cap);
        if (b->n) memcpy(p, b->s, b->n);
        b->s = p;
        b->cap = cap;
    }
    if (n) memcpy(b->s + b->n, s, n);
    b->n += n;
}

static void sb_puts(rt *r, sbuf *b, const char *s) { sb_put(r, b, s, strlen(s)); }

static val sb_val(sbuf *b) { return v_str(b->s ? b->s : "", b->n); }

static bool name_eq(const char *a, size_t an, const char *b) {
    return an == strlen(b) && memcmp(a, b, an) == 0;
}

static val *scope_find(scope *s, const char *name, size_t n) {
    for (binding *b = s->head; b; b = b->next)
        if (b->n == n && memcmp(b->name, name, n) == 0) return &b->v;
    return NULL;
}

static void scope_set(rt *r, scope *s, const char *name, size_t n, val v) {
    val *slot = scope_find(s, name, n);
    if (slot) {
        *slot = v;
        return;
    }
    binding *b = ralloc(r, sizeof(*b));
    *b = (binding){.next = s->head, .name = name, .n = n, .v = v};
    s->head = b;
}

/* ---- runtime: containers and conversion --------------------------------------- */

static list *list_new(rt *r, size_t cap) {
    list *l = ralloc(r, sizeof(*l));
    *l = (list){.v = cap ? ralloc(r, cap * sizeof(val)) : NULL, .n = 0, .cap = cap};
    return l;
}

static void list_push(rt *r, list *l, val v) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 4;
        val *p = ralloc(r, cap * sizeof(val));
        if (l->n) memcpy(p, l->v, l->n * sizeof(val));
        l->v = p;
        l->cap = cap;
    }
    l->v[l->n++] = v;
}

static val v_list(list *l) { return (val){.k = V_LIST, .u.l = l}; }

static dict *dict_new(rt *r) {
    dict *d = ralloc(r, sizeof(*d));
    *d = (dict){0};
    return d;
}

static val *dict_get(const dict *d, const char *k, size_t n) {
    for (size_t i = 0; i < d->n; i++)
        if (d->key_len[i] == n && memcmp(d->key[i], k, n) == 0) return &d->v[i];
    return NULL;
}

/* Adds a key the dict does not have. */
static void dict_append(rt *r, dict *d, const char *k, size_t n, val v) {
    if (d->n == d->cap) {
        size_t cap = d->cap ? 2 * d->cap : 8;
        const char **key = ralloc(r, cap * sizeof(*key));
        size_t *len = ralloc(r, cap * sizeof(*len));
        val *vs = ralloc(r, cap * sizeof(*vs));
        if (d->n) {
            memcpy(key, d->key, d->n * sizeof(*key));
            memcpy(len, d->key_len, d->n * sizeof(*len));
            memcpy(vs, d->v, d->n * sizeof(*vs));
        }
        d->key = key, d->key_len = len, d->v = vs, d->cap = cap;
    }
    d->key[d->n] = k, d->key_len[d->n] = n, d->v[d->n++] = v;
}

static void dict_set(rt *r, dict *d, const char *k, size_t n, val v) {
    val *slot = dict_get(d, k, n);
    if (slot) {
        *slot = v;
        return;
    }
    dict_append(r, d, k, n, v);
}

static val from_json(rt *r, const json_t *j, unsigned depth);

static val from_json_container(rt *r, const json_t *j, unsigned depth) {
    if (depth > DATA_DEPTH_MAX) rfail(r, NULL, "the context nests deeper than %u", DATA_DEPTH_MAX);
    if (json_is_array(j)) {
        list *l = list_new(r, json_array_size(j));
        for (size_t i = 0; i < json_array_size(j); i++)
            list_push(r, l, from_json(r, json_array_get(j, i), depth + 1));
        return v_list(l);
    }
    dict *d = dict_new(r);
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)j, key, v) { /* keys are unique: no lookup, O(n) */
        dict_append(r, d, key, strlen(key), from_json(r, v, depth + 1));
    }
    return (val){.k = V_DICT, .u.d = d};
}

/* As the reference converts JavaScript values: a whole number is an integer. */
static val from_json(rt *r, const json_t *j, unsigned depth) {
    switch (json_typeof(j)) {
    case JSON_NULL: return NONE;
    case JSON_TRUE: return v_bool(true);
    case JSON_FALSE: return v_bool(false);
    case JSON_INTEGER: return v_int(json_integer_value(j));
    case JSON_REAL: {
        double f = json_real_value(j);
        if (f == floor(f) && fabs(f) < 9007199254740992.0) return v_int((int64_t)f);
        return v_float(f);
    }
    case JSON_STRING: return v_str(json_string_value(j), json_string_length(j));
    default: return from_json_container(r, j, depth);
    }
}

/* ---- runtime: printing as JavaScript prints ------------------------------------- */

/* Number.prototype.toString: the shortest digits that read back to f, in
 * plain notation for exponents -7 < e < 21 and in e-notation beyond. */
static void js_number(double f, char *buf, size_t cap) {
    if (isnan(f)) {
        snprintf(buf, cap, "NaN");
        return;
    }
    if (isinf(f) || f == 0) {
        snprintf(buf, cap, "%s", isinf(f) ? (f < 0 ? "-Infinity" : "Infinity") : "0");
        return;
    }
    char e[40], digits[24];
    for (int p = 1; p <= 17; p++) {
        snprintf(e, sizeof(e), "%.*e", p - 1, f);
        if (strtod(e, NULL) == f) break;
    }
    const char *s = e + (e[0] == '-');
    size_t k = 0;
    for (; *s && *s != 'e'; s++)
        if (*s != '.') digits[k++] = *s;
    digits[k] = 0;
    int n = atoi(s + 1) + 1; /* the decimal point sits after n digits */
    const char *sign = f < 0 ? "-" : "";
    if ((int)k <= n && n <= 21) {
        snprintf(buf, cap, "%s%s%0*d", sign, digits, n - (int)k, 0);
        if (n == (int)k) snprintf(buf, cap, "%s%s", sign, digits);
    } else if (0 < n && n <= 21) {
        snprintf(buf, cap, "%s%.*s.%s", sign, n, digits, digits + n);
    } else if (-6 < n && n <= 0) {
        snprintf(buf, cap, "%s0.%0*d%s", sign, -n, 0, digits);
        if (n == 0) snprintf(buf, cap, "%s0.%s", sign, digits);
    } else {
        snprintf(buf, cap, "%s%c%s%s%se%c%d", sign, digits[0], k > 1 ? "." : "", digits + 1, "",
                 n - 1 < 0 ? '-' : '+', abs(n - 1));
    }
}

static void sb_int(rt *r, sbuf *b, int64_t i) {
    char buf[32];
    snprintf(buf, sizeof(buf), "%lld", (long long)i);
    sb_puts(r, b, buf);
}

static void sb_json_string(rt *r, sbuf *b, const char *s, size_t n) {
    sb_put(r, b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        const char *esc = ch == '"' ? "\\\""
            : ch == '\\'            ? "\\\\"
            : ch == '\n'            ? "\\n"
            : ch == '\r'            ? "\\r"
            : ch == '\t'            ? "\\t"
            : ch == '\b'            ? "\\b"
            : ch == '\f'            ? "\\f"
                                    : NULL;
        char u[8];
        if (!esc && ch < 0x20) {
            snprintf(u, sizeof(u), "\\u%04x", ch);
            esc = u;
        }
        if (esc) {
            sb_puts(r, b, esc);
        } else {
            sb_put(r, b, s + i, 1);
        }
    }
    sb_put(r, b, "\"", 1);
}

/* How tojson lays a container out: the reference's separators (", " and
 * ": ", or "," before a new line when indenting), as Python's json.dumps. */
typedef struct json_style {
    bool undef_null; /* undefined as null (tojson) or as undefined (printing) */
    unsigned indent; /* spaces per level; 0 for one line */
} json_style;

static void to_json(rt *r, sbuf *b, val v, json_style st, unsigned depth);

/* Before item i of a container at depth (i == count: before the closer). */
static void json_gap(rt *r, sbuf *b, json_style st, size_t i, size_t count, unsigned depth) {
    if (i > 0 && i < count) sb_put(r, b, st.indent ? "," : ", ", st.indent ? 1 : 2);
    if (!st.indent || count == 0) return;
    sb_put(r, b, "\n", 1);
    for (size_t k = 0; k < (size_t)st.indent * (depth + (i < count)); k++) sb_put(r, b, " ", 1);
}

static void to_json_container(rt *r, sbuf *b, val v, json_style st, unsigned depth) {
    bool is_list = v.k == V_LIST;
    size_t count = is_list ? v.u.l->n : v.u.d->n;
    sb_put(r, b, is_list ? "[" : "{", 1);
    for (size_t i = 0; i < count; i++) {
        json_gap(r, b, st, i, count, depth);
        if (!is_list) {
            sb_json_string(r, b, v.u.d->key[i], v.u.d->key_len[i]);
            sb_put(r, b, ": ", 2);
        }
        to_json(r, b, is_list ? v.u.l->v[i] : v.u.d->v[i], st, depth + 1);
    }
    json_gap(r, b, st, count, count, depth);
    sb_put(r, b, is_list ? "]" : "}", 1);
}

/* The reference's toJSON. */
static void to_json(rt *r, sbuf *b, val v, json_style st, unsigned depth) {
    char num[40];
    if (depth > DATA_DEPTH_MAX) rfail(r, NULL, "tojson: nesting deeper than %u", DATA_DEPTH_MAX);
    switch (v.k) {
    case V_UNDEF: sb_puts(r, b, st.undef_null ? "null" : "undefined"); return;
    case V_NONE: sb_puts(r, b, "null"); return;
    case V_BOOL: sb_puts(r, b, v.u.b ? "true" : "false"); return;
    case V_INT: sb_int(r, b, v.u.i); return;
    case V_FLOAT:
        js_number(v.u.f, num, sizeof(num));
        sb_puts(r, b, isfinite(v.u.f) ? num : "null");
        return;
    case V_STR: sb_json_string(r, b, v.u.str.s, v.u.str.n); return;
    case V_LIST:
    case V_DICT:
    case V_NS: to_json_container(r, b, v, st, depth); return;
    case V_FUNC: rfail(r, NULL, "cannot convert a function to JSON");
    }
}

static const char *kind_name(vkind k) {
    static const char *const NAMES[] = {"undefined",   "none",      "a boolean", "an integer",
                                        "a float",     "a string",  "a list",    "a dict",
                                        "a namespace", "a function"};
    return NAMES[k];
}

/* What {{ v }} prints (RuntimeValue.toString); none and undefined print nothing. */
static void display(rt *r, const node *at, sbuf *b, val v) {
    char num[40];
    switch (v.k) {
    case V_UNDEF:
    case V_NONE: return;
    case V_BOOL: sb_puts(r, b, v.u.b ? "true" : "false"); return;
    case V_INT: sb_int(r, b, v.u.i); return;
    case V_FLOAT:
        if (v.u.f == 0 && signbit(v.u.f)) {
            sb_puts(r, b, "-0.0");
        } else if (isfinite(v.u.f) && v.u.f == floor(v.u.f) && fabs(v.u.f) < 1e21) {
            snprintf(num, sizeof(num), "%.1f", v.u.f);
            sb_puts(r, b, num);
        } else {
            js_number(v.u.f, num, sizeof(num));
            sb_puts(r, b, num);
        }
        return;
    case V_STR: sb_put(r, b, v.u.str.s, v.u.str.n); return;
    case V_LIST:
    case V_DICT:
    case V_NS: to_json(r, b, v, (json_style){.undef_null = false}, 0); return;
    case V_FUNC: rfail(r, at, "cannot print a function");
    }
}

/* The text `~`, `+` and join use: JavaScript's String(value). */
static void concat_part(rt *r, const node *at, sbuf *b, val v) {
    char num[40];
    if (v.k == V_FLOAT) {
        js_number(v.u.f, num, sizeof(num));
        sb_puts(r, b, num);
    } else if (v.k == V_STR || v.k == V_INT || v.k == V_BOOL) {
        display(r, at, b, v);
    } else {
        rfail(r, at, "cannot use %s as text", kind_name(v.k));
    }
}

static bool truthy(val v) {
    switch (v.k) {
    case V_UNDEF:
    case V_NONE: return false;
    case V_BOOL: return v.u.b;
    case V_INT: return v.u.i != 0;
    case V_FLOAT: return v.u.f != 0 && !isnan(v.u.f);
    case V_STR: return v.u.str.n > 0;
    case V_LIST: return v.u.l->n > 0;
    case V_DICT: return v.u.d->n > 0;
    default: return true;
    }
}

static bool is_num(val v) { return v.k == V_INT || v.k == V_FLOAT; }
static double num_of(val v) {
    return v.k == V_INT ? (double)v.u.i : v.k == V_FLOAT ? v.u.f : v.u.b ? 1.0 : 0.0;
}

static bool str_eq(val a, val b) {
    return a.u.str.n == b.u.str.n && memcmp(a.u.str.s, b.u.str.s, a.u.str.n) == 0;
}

/* JavaScript's ===, on the values under the reference's wrappers. */
static bool strict_eq(val a, val b) {
    if (is_num(a) && is_num(b)) {
        if (a.k == V_INT && b.k == V_INT) return a.u.i == b.u.i;
        return num_of(a) == num_of(b);
    }
    if (a.k != b.k) return false;
    switch (a.k) {
    case V_UNDEF:
    case V_NONE: return true;
    case V_BOOL: return a.u.b == b.u.b;
    case V_STR: return str_eq(a, b);
    case V_LIST: return a.u.l == b.u.l;
    case V_DICT:
    case V_NS: return a.u.d == b.u.d;
    default: return false;
    }
}

/* JavaScript's == as the reference's `==` uses it, without string-to-number
 * coercion (a template comparing "1" with 1 gets false). */
static bool loose_eq(val a, val b) {
    bool a_nullish = a.k == V_UNDEF || a.k == V_NONE, b_nullish = b.k == V_UNDEF || b.k == V_NONE;
    if (a_nullish || b_nullish) return a_nullish && b_nullish;
    bool a_num = is_num(a) || a.k == V_BOOL, b_num = is_num(b) || b.k == V_BOOL;
    if (a_num && b_num) {
        if (a.k == V_INT && b.k == V_INT) return a.u.i == b.u.i;
        return num_of(a) == num_of(b);
    }
    return strict_eq(a, b);
}

/* ---- runtime: strings by code point ---------------------------------------------- */

static size_t cp_len(const char *s, size_t n, size_t i) {
    size_t k = 1;
    while (i + k < n && ((unsigned char)s[i + k] & 0xC0) == 0x80) k++;
    return k;
}

/* Counts as cp_len walks, so that a stray continuation byte (a template's
 * literal need not be valid UTF-8) is one code point here as there. */
static size_t cp_count(const char *s, size_t n) {
    size_t count = 0;
    for (size_t i = 0; i < n; i += cp_len(s, n, i)) count++;
    return count;
}

/* Byte offsets of the code points of s, plus n at the end (count + 1 entries). */
static size_t *cp_offsets(rt *r, const char *s, size_t n, size_t *count) {
    *count = cp_count(s, n);
    size_t *off = ralloc(r, (*count + 1) * sizeof(size_t));
    size_t k = 0;
    for (size_t i = 0; i < n; i += cp_len(s, n, i)) off[k++] = i;
    off[k] = n;
    PD_ASSERT(k == *count);
    return off;
}

static val str_cp_at(rt *r, val s, int64_t idx) {
    size_t count;
    size_t *off = cp_offsets(r, s.u.str.s, s.u.str.n, &count);
    if (idx < 0) idx += (int64_t)count;
    if (idx < 0 || idx >= (int64_t)count) return UNDEF;
    return v_str(s.u.str.s + off[idx], off[idx + 1] - off[idx]);
}

/* Does the code point at s[i] occur in chars? */
static bool cp_in(const char *s, size_t n, size_t i, val chars) {
    size_t k = cp_len(s, n, i);
    for (size_t j = 0; j < chars.u.str.n; j += cp_len(chars.u.str.s, chars.u.str.n, j))
        if (cp_len(chars.u.str.s, chars.u.str.n, j) == k && !memcmp(chars.u.str.s + j, s + i, k))
            return true;
    return false;
}

/* strip/lstrip/rstrip: JavaScript's whitespace without an argument, Python's
 * set of characters with one. */
static val str_strip(val s, bool left, bool right, const val *chars) {
    const char *p = s.u.str.s;
    size_t b = 0, e = s.u.str.n;
    if (!chars) {
        if (left) b = js_trim_start(p, e, 0);
        if (right && e > b) e = b + js_trim_end(p + b, e - b);
        return v_str(p + b, e - b);
    }
    while (left && b < e && cp_in(p, e, b, *chars)) b += cp_len(p, e, b);
    while (right && e > b) {
        size_t k = 1;
        while (k < e - b && ((unsigned char)p[e - k] & 0xC0) == 0x80) k++;
        if (!cp_in(p, e, e - k, *chars)) break;
        e -= k;
    }
    return v_str(p + b, e - b);
}

static const char *find_sub(const char *s, size_t n, const char *sub, size_t m) {
    if (m == 0) return s;
    for (size_t i = 0; i + m <= n; i++)
        if (s[i] == sub[0] && memcmp(s + i, sub, m) == 0) return s + i;
    return NULL;
}

static val str_split(rt *r, const node *at, val s, const val *sep, int64_t maxsplit) {
    list *l = list_new(r, 4);
    const char *p = s.u.str.s, *end = p + s.u.str.n;
    if (!sep) {
        for (size_t i = js_trim_start(p, s.u.str.n, 0); i < s.u.str.n;) {
            size_t j = i;
            bool last = maxsplit >= 0 && (int64_t)l->n >= maxsplit;
            while (j < s.u.str.n && (last || !js_space_at(p, s.u.str.n, j))) j++;
            if (last) j = i + js_trim_end(p + i, s.u.str.n - i);
            list_push(r, l, v_str(p + i, j - i));
            i = js_trim_start(p, s.u.str.n, j);
        }
        return v_list(l);
    }
    if (sep->u.str.n == 0) rfail(r, at, "split: empty separator");
    for (;;) {
        const char *hit = (maxsplit < 0 || (int64_t)l->n < maxsplit)
            ? find_sub(p, (size_t)(end - p), sep->u.str.s, sep->u.str.n)
            : NULL;
        if (!hit) break;
        list_push(r, l, v_str(p, (size_t)(hit - p)));
        p = hit + sep->u.str.n;
    }
    list_push(r, l, v_str(p, (size_t)(end - p)));
    return v_list(l);
}

static val str_replace(rt *r, const node *at, val s, val from, val to, int64_t count) {
    if (from.u.str.n == 0) rfail(r, at, "replace: empty pattern");
    sbuf b = {0};
    const char *p = s.u.str.s, *end = p + s.u.str.n;
    for (int64_t done = 0; count < 0 || done < count; done++) {
        const char *hit = find_sub(p, (size_t)(end - p), from.u.str.s, from.u.str.n);
        if (!hit) break;
        sb_put(r, &b, p, (size_t)(hit - p));
        sb_put(r, &b, to.u.str.s, to.u.str.n);
        p = hit + from.u.str.n;
    }
    sb_put(r, &b, p, (size_t)(end - p));
    return sb_val(&b);
}

static val str_case(rt *r, val s, bool upper) {
    char *o = ralloc(r, s.u.str.n + 1);
    for (size_t i = 0; i < s.u.str.n; i++) {
        char ch = s.u.str.s[i];
        if (upper && ch >= 'a' && ch <= 'z') ch = (char)(ch - 'a' + 'A');
        if (!upper && ch >= 'A' && ch <= 'Z') ch = (char)(ch - 'A' + 'a');
        o[i] = ch;
    }
    return v_str(o, s.u.str.n);
}

static bool str_affix(rt *r, const node *at, val s, val arg, bool prefix) {
    if (arg.k == V_LIST) {
        for (size_t i = 0; i < arg.u.l->n; i++)
            if (str_affix(r, at, s, arg.u.l->v[i], prefix)) return true;
        return false;
    }
    if (arg.k != V_STR)
        rfail(r, at, "%s: the argument must be a string or a list of strings",
              prefix ? "startswith" : "endswith");
    if (arg.u.str.n > s.u.str.n) return false;
    const char *p = prefix ? s.u.str.s : s.u.str.s + s.u.str.n - arg.u.str.n;
    return memcmp(p, arg.u.str.s, arg.u.str.n) == 0;
}

/* ---- runtime: expressions ---------------------------------------------------------- */

static val eval(rt *r, const node *e);

/* The reference's slice(): start, stop, step clamped as it clamps them. */
static size_t slice_indices(int64_t len, const val *part, int64_t *first, int64_t *step) {
    int64_t st = part[2].k == V_INT ? part[2].u.i : 1;
    int64_t a, b;
    if (st >= 0) {
        a = part[0].k == V_INT ? part[0].u.i : 0;
        b = part[1].k == V_INT ? part[1].u.i : len;
        a = a < 0 ? PD_MAX(len + a, 0) : PD_MIN(a, len);
        b = b < 0 ? PD_MAX(len + b, 0) : PD_MIN(b, len);
    } else {
        a = part[0].k == V_INT ? part[0].u.i : len - 1;
        b = part[1].k == V_INT ? part[1].u.i : -1;
        a = a < 0 ? PD_MAX(len + a, -1) : PD_MIN(a, len - 1);
        b = b < -1 ? PD_MAX(len + b, -1) : PD_MIN(b, len - 1);
    }
    *first = a;
    *step = st;
    if (st > 0) return a < b ? (size_t)((b - a + st - 1) / st) : 0;
    return a > b ? (size_t)((a - b + (-st) - 1) / (-st)) : 0;
}

static val eval_slice(rt *r, const node *e) {
    val obj = eval(r, e->a);
    const node *pn[3] = {e->b, e->c, e->alt[0]};
    val part[3];
    for (int k = 0; k < 3; k++) {
        part[k] = pn[k] ? eval(r, pn[k]) : UNDEF;
        if (part[k].k != V_INT && part[k].k != V_UNDEF)
            rfail(r, e, "slice bounds must be integers, not %s", kind_name(part[k].k));
    }
    if (part[2].k == V_INT && part[2].u.i == 0) rfail(r, e, "slice step cannot be zero");
    if (obj.k != V_LIST && obj.k != V_STR) rfail(r, e, "cannot slice %s", kind_name(obj.k));
    size_t count = obj.k == V_LIST ? obj.u.l->n : 0, *off = NULL;
    if (obj.k == V_STR) off = cp_offsets(r, obj.u.str.s, obj.u.str.n, &count);
    int64_t i, st;
    size_t n = slice_indices((int64_t)count, part, &i, &st);
    if (obj.k == V_LIST) {
        list *l = list_new(r, n);
        for (size_t k = 0; k < n; k++, i += st) list_push(r, l, obj.u.l->v[i]);
        return v_list(l);
    }
    sbuf b = {0};
    for (size_t k = 0; k < n; k++, i += st)
        sb_put(r, &b, obj.u.str.s + off[i], off[i + 1] - off[i]);
    return sb_val(&b);
}

static bool is_method_of(val obj, const char *name, size_t n) {
    static const char *const STR_METHODS[] = {"startswith", "endswith", "split", "strip", "lstrip",
                                              "rstrip",     "replace",  "upper", "lower"};
    static const char *const DICT_METHODS[] = {"get", "items", "keys", "values"};
    if (obj.k == V_STR) return in_set(STR_METHODS, PD_ARRAY_LEN(STR_METHODS), name, n);
    if (obj.k == V_DICT) return in_set(DICT_METHODS, PD_ARRAY_LEN(DICT_METHODS), name, n);
    return false;
}

/* obj.key and obj[key]: a missing key is undefined, as in the reference. */
static val member(rt *r, const node *e, val obj, val key) {
    if (obj.k == V_DICT || obj.k == V_NS) {
        if (key.k != V_STR) rfail(r, e, "dict keys are strings, not %s", kind_name(key.k));
        val *v = dict_get(obj.u.d, key.u.str.s, key.u.str.n);
        if (v) return *v;
    } else if ((obj.k == V_LIST || obj.k == V_STR) && key.k == V_INT) {
        if (obj.k == V_STR) return str_cp_at(r, obj, key.u.i);
        int64_t i = key.u.i < 0 ? key.u.i + (int64_t)obj.u.l->n : key.u.i;
        return i >= 0 && i < (int64_t)obj.u.l->n ? obj.u.l->v[i] : UNDEF;
    } else if (key.k != V_STR) {
        rfail(r, e, "cannot index %s with %s", kind_name(obj.k), kind_name(key.k));
    }
    if ((obj.k == V_LIST || obj.k == V_STR) && name_eq(key.u.str.s, key.u.str.n, "length"))
        return v_int(obj.k == V_LIST ? (int64_t)obj.u.l->n
                                     : (int64_t)cp_count(obj.u.str.s, obj.u.str.n));
    if (is_method_of(obj, key.u.str.s, key.u.str.n)) return (val){.k = V_FUNC};
    return UNDEF;
}

typedef struct args {
    val pos[4];
    size_t npos;
    const node *kw[4];
    val kwv[4];
    size_t nkw;
} args;

static void eval_args(rt *r, const node *call, args *a) {
    *a = (args){.npos = 0};
    for (size_t i = 0; i < call->nkid; i++) {
        const node *k = call->kid[i];
        if ((k->kind == N_KWARG ? a->nkw : a->npos) == 4) rfail(r, call, "more than 4 arguments");
        if (k->kind == N_KWARG) {
            a->kw[a->nkw] = k;
            a->kwv[a->nkw++] = eval(r, k->a);
        } else {
            a->pos[a->npos++] = eval(r, k);
        }
    }
}

/* Positional argument i, or keyword name, or NULL. */
static const val *arg(const args *a, size_t i, const char *name) {
    if (i < a->npos) return &a->pos[i];
    for (size_t k = 0; name && k < a->nkw; k++)
        if (name_eq(a->kw[k]->s, a->kw[k]->n, name)) return &a->kwv[k];
    return NULL;
}

static const val *arg_str(rt *r, const node *e, const args *a, size_t i, const char *name) {
    const val *v = arg(a, i, name);
    if (v && v->k == V_NONE) return NULL;
    if (v && v->k != V_STR)
        rfail(r, e, "%.*s: argument %zu must be a string", (int)e->a->n, e->a->s, i + 1);
    return v;
}

static int64_t arg_int(rt *r, const node *e, const args *a, size_t i, const char *name) {
    const val *v = arg(a, i, name);
    if (!v || v->k == V_NONE) return -1;
    if (v->k != V_INT)
        rfail(r, e, "%.*s: argument %zu must be an integer", (int)e->a->n, e->a->s, i + 1);
    return v->u.i;
}

static val dict_items(rt *r, const dict *d, int what) { /* 0 items, 1 keys, 2 values */
    list *l = list_new(r, d->n);
    for (size_t i = 0; i < d->n; i++) {
        val k = v_str(d->key[i], d->key_len[i]);
        if (what == 0) {
            list *pair = list_new(r, 2);
            list_push(r, pair, k);
            list_push(r, pair, d->v[i]);
            list_push(r, l, v_list(pair));
        } else {
            list_push(r, l, what == 1 ? k : d->v[i]);
        }
    }
    return v_list(l);
}

static val call_str_method(rt *r, const node *e, val s, const args *a) {
    const char *m = e->a->s;
    size_t n = e->a->n;
    if (name_eq(m, n, "upper") || name_eq(m, n, "lower")) return str_case(r, s, m[0] == 'u');
    if (name_eq(m, n, "strip") || name_eq(m, n, "lstrip") || name_eq(m, n, "rstrip"))
        return str_strip(s, m[0] != 'r', m[0] != 'l', arg_str(r, e, a, 0, "chars"));
    if (name_eq(m, n, "startswith") || name_eq(m, n, "endswith")) {
        if (!arg(a, 0, NULL)) rfail(r, e, "%.*s() needs an argument", (int)n, m);
        return v_bool(str_affix(r, e, s, *arg(a, 0, NULL), m[0] == 's'));
    }
    if (name_eq(m, n, "split"))
        return str_split(r, e, s, arg_str(r, e, a, 0, "sep"), arg_int(r, e, a, 1, "maxsplit"));
    const val *from = arg_str(r, e, a, 0, NULL), *to = arg_str(r, e, a, 1, NULL);
    if (!from || !to) rfail(r, e, "replace() needs two strings");
    return str_replace(r, e, s, *from, *to, arg_int(r, e, a, 2, "count"));
}

static val call_method(rt *r, const node *e, val obj, const args *a) {
    const char *m = e->a->s;
    size_t n = e->a->n;
    if (!is_method_of(obj, m, n))
        rfail(r, e, "%s has no method '%.*s'", kind_name(obj.k), (int)n, m);
    if (obj.k == V_STR) return call_str_method(r, e, obj, a);
    if (name_eq(m, n, "get")) {
        const val *key = arg(a, 0, NULL), *dflt = arg(a, 1, NULL);
        if (!key || key->k != V_STR) rfail(r, e, "get(): the key must be a string");
        val *v = dict_get(obj.u.d, key->u.str.s, key->u.str.n);
        return v ? *v : dflt ? *dflt : NONE;
    }
    return dict_items(r, obj.u.d, name_eq(m, n, "items") ? 0 : name_eq(m, n, "keys") ? 1 : 2);
}

#define RANGE_MAX (1u << 20)

/* range(stop) or range(start, stop[, step]), as a list. */
static val fn_range(rt *r, const node *e, const args *a) {
    int64_t v[3] = {0, 0, 1};
    if (a->npos < 1 || a->npos > 3 || a->nkw) rfail(r, e, "range() takes 1 to 3 integers");
    for (size_t i = 0; i < a->npos; i++) {
        if (a->pos[i].k != V_INT) rfail(r, e, "range() takes integers");
        v[a->npos == 1 ? 1 : i] = a->pos[i].u.i;
    }
    if (v[2] == 0) rfail(r, e, "range() step must not be zero");
    double count = ceil(((double)v[1] - (double)v[0]) / (double)v[2]);
    if (count > RANGE_MAX) rfail(r, e, "range() of more than %u numbers", RANGE_MAX);
    list *l = list_new(r, count > 0 ? (size_t)count : 0);
    for (int64_t x = v[0]; v[2] > 0 ? x < v[1] : x > v[1]; x += v[2]) list_push(r, l, v_int(x));
    return v_list(l);
}

/* strftime_now(format) in UTC, with the reference's directives: %Y %m %d
 * %b %B %H %M %%; any other is kept as written. */
static val fn_strftime_now(rt *r, const node *e, const args *a) {
    static const char *const MONTH[] = {"January",   "February", "March",    "April",
                                        "May",       "June",     "July",     "August",
                                        "September", "October",  "November", "December"};
    if (a->npos != 1 || a->pos[0].k != V_STR) rfail(r, e, "strftime_now() takes a format string");
    time_t now = time(NULL);
    struct tm tm;
    if (!gmtime_r(&now, &tm)) rfail(r, e, "strftime_now(): no clock");
    val f = a->pos[0];
    sbuf b = {0};
    for (size_t i = 0; i < f.u.str.n; i++) {
        char d = i + 1 < f.u.str.n && f.u.str.s[i] == '%' ? f.u.str.s[i + 1] : 0;
        char buf[16];
        int n = d == 'Y' ? snprintf(buf, sizeof(buf), "%d", tm.tm_year + 1900)
            : d == 'm'   ? snprintf(buf, sizeof(buf), "%02d", tm.tm_mon + 1)
            : d == 'd'   ? snprintf(buf, sizeof(buf), "%02d", tm.tm_mday)
            : d == 'b'   ? snprintf(buf, sizeof(buf), "%.3s", MONTH[tm.tm_mon])
            : d == 'B'   ? snprintf(buf, sizeof(buf), "%s", MONTH[tm.tm_mon])
            : d == 'H'   ? snprintf(buf, sizeof(buf), "%02d", tm.tm_hour)
            : d == 'M'   ? snprintf(buf, sizeof(buf), "%02d", tm.tm_min)
            : d == '%'   ? snprintf(buf, sizeof(buf), "%%")
                         : -1;
        if (n < 0) {
            sb_put(r, &b, f.u.str.s + i, 1);
            continue;
        }
        sb_put(r, &b, buf, (size_t)n);
        i++;
    }
    return sb_val(&b);
}

static val call_function(rt *r, const node *e, const args *a) {
    if (name_eq(e->a->s, e->a->n, "range")) return fn_range(r, e, a);
    if (name_eq(e->a->s, e->a->n, "strftime_now")) return fn_strftime_now(r, e, a);
    if (name_eq(e->a->s, e->a->n, "raise_exception")) {
        sbuf b = {0};
        if (a->npos) display(r, e, &b, a->pos[0]);
        sb_put(r, &b, "", 1);
        fail(&r->f, PD_ERR_INVALID, "%s", b.s);
    }
    dict *d = dict_new(r);
    if (a->npos > 1 || (a->npos == 1 && a->pos[0].k != V_DICT))
        rfail(r, e, "namespace() takes keyword arguments or one dict");
    for (size_t i = 0; a->npos == 1 && i < a->pos[0].u.d->n; i++)
        dict_set(r, d, a->pos[0].u.d->key[i], a->pos[0].u.d->key_len[i], a->pos[0].u.d->v[i]);
    for (size_t i = 0; i < a->nkw; i++) dict_set(r, d, a->kw[i]->s, a->kw[i]->n, a->kwv[i]);
    return (val){.k = V_NS, .u.d = d};
}

static val lookup(rt *r, const node *e) {
    for (scope *s = r->sc; s; s = s->parent) {
        val *v = scope_find(s, e->s, e->n);
        if (v) return *v;
    }
    if (name_eq(e->s, e->n, "true") || name_eq(e->s, e->n, "True")) return v_bool(true);
    if (name_eq(e->s, e->n, "false") || name_eq(e->s, e->n, "False")) return v_bool(false);
    if (name_eq(e->s, e->n, "none") || name_eq(e->s, e->n, "None")) return NONE;
    if (in_set(FUNCTIONS, PD_ARRAY_LEN(FUNCTIONS), e->s, e->n)) return (val){.k = V_FUNC};
    return UNDEF;
}

static val eval_call(rt *r, const node *e) {
    args a;
    if (e->a->kind == N_ATTR) {
        val obj = eval(r, e->a->a);
        eval_args(r, e, &a);
        return call_method(r, e, obj, &a);
    }
    PD_ASSERT(e->a->kind == N_NAME); /* check_call let nothing else through */
    if (lookup(r, e->a).k != V_FUNC)
        rfail(r, e, "'%.*s' is not a function here", (int)e->a->n, e->a->s);
    eval_args(r, e, &a);
    return call_function(r, e, &a);
}

/* ---- runtime: filters and tests ------------------------------------------------------ */

static val filter_join(rt *r, const node *e, val v, const args *a) {
    const val *sep = arg(a, 0, "separator");
    if (sep && sep->k != V_STR) rfail(r, e, "join: the separator must be a string");
    sbuf b = {0};
    size_t count = 0, *off = NULL;
    if (v.k == V_STR) off = cp_offsets(r, v.u.str.s, v.u.str.n, &count);
    if (v.k == V_LIST) count = v.u.l->n;
    if (v.k != V_STR && v.k != V_LIST) rfail(r, e, "join: cannot join %s", kind_name(v.k));
    for (size_t i = 0; i < count; i++) {
        if (i && sep) sb_put(r, &b, sep->u.str.s, sep->u.str.n);
        if (v.k == V_STR) {
            sb_put(r, &b, v.u.str.s + off[i], off[i + 1] - off[i]);
        } else if (v.u.l->v[i].k != V_NONE && v.u.l->v[i].k != V_UNDEF) {
            concat_part(r, e, &b, v.u.l->v[i]);
        }
    }
    return sb_val(&b);
}

static val filter_list(rt *r, const node *e, val v) {
    const char *f = e->s;
    size_t n = e->n, len = v.u.l->n;
    if (name_eq(f, n, "first")) return len ? v.u.l->v[0] : UNDEF;
    if (name_eq(f, n, "last")) return len ? v.u.l->v[len - 1] : UNDEF;
    if (name_eq(f, n, "length")) return v_int((int64_t)len);
    if (name_eq(f, n, "list")) return v;
    if (name_eq(f, n, "reverse")) {
        list *l = list_new(r, len);
        for (size_t i = len; i > 0; i--) list_push(r, l, v.u.l->v[i - 1]);
        return v_list(l);
    }
    if (name_eq(f, n, "string")) {
        sbuf b = {0};
        to_json(r, &b, v, (json_style){.undef_null = false}, 0);
        return sb_val(&b);
    }
    rfail(r, e, "the filter '%.*s' does not apply to a list", (int)n, f);
}

static val filter_scalar(rt *r, const node *e, val v) {
    const char *f = e->s;
    size_t n = e->n;
    if (v.k == V_STR) {
        if (name_eq(f, n, "length")) return v_int((int64_t)cp_count(v.u.str.s, v.u.str.n));
        if (name_eq(f, n, "upper") || name_eq(f, n, "lower")) return str_case(r, v, f[0] == 'u');
        if (name_eq(f, n, "trim")) return str_strip(v, true, true, NULL);
        if (name_eq(f, n, "string")) return v;
    } else if (v.k == V_DICT) {
        if (name_eq(f, n, "items")) return dict_items(r, v.u.d, 0);
        if (name_eq(f, n, "length")) return v_int((int64_t)v.u.d->n);
    } else if ((is_num(v) || v.k == V_BOOL) && name_eq(f, n, "string")) {
        sbuf b = {0};
        display(r, e, &b, v);
        return sb_val(&b);
    }
    rfail(r, e, "the filter '%.*s' does not apply to %s", (int)n, f, kind_name(v.k));
}

static bool apply_test(rt *r, const node *e, const char *t, size_t n, val v, const val *arg);

static bool is_container(val v) { return v.k == V_DICT || v.k == V_NS; }

/* selectattr/rejectattr: items whose attribute exists and passes the test
 * (its truth without one); rejectattr keeps the others. */
static val filter_select(rt *r, const node *e, val v, const args *a) {
    bool select = e->s[0] == 's';
    if (v.k != V_LIST) rfail(r, e, "'%.*s' applies to a list", (int)e->n, e->s);
    const val *attr = arg(a, 0, NULL), *test = arg(a, 1, NULL), *value = arg(a, 2, NULL);
    list *l = list_new(r, v.u.l->n);
    for (size_t i = 0; i < v.u.l->n; i++) {
        val item = v.u.l->v[i];
        if (!is_container(item)) rfail(r, e, "'%.*s' applies to a list of dicts", (int)e->n, e->s);
        const val *x = dict_get(item.u.d, attr->u.str.s, attr->u.str.n);
        bool hit = x &&
            (test ? apply_test(r, e, test->u.str.s, test->u.str.n, *x, value) : truthy(*x));
        if (hit == select) list_push(r, l, item);
    }
    return v_list(l);
}

/* map(attribute='a.b'[, default=x]): each item's attribute, by dotted path. */
static val filter_map(rt *r, const node *e, val v, const args *a) {
    const val *attr = arg(a, 99, "attribute"), *dflt = arg(a, 99, "default");
    if (v.k != V_LIST || !attr || attr->k != V_STR || a->npos)
        rfail(r, e, "only map(attribute='name') on a list is supported");
    list *l = list_new(r, v.u.l->n);
    for (size_t i = 0; i < v.u.l->n; i++) {
        val x = v.u.l->v[i];
        if (!is_container(x)) rfail(r, e, "map: the items must be dicts");
        const char *p = attr->u.str.s, *end = p + attr->u.str.n;
        for (const char *dot; x.k != V_UNDEF; p = dot + 1) {
            dot = memchr(p, '.', (size_t)(end - p));
            if (!dot) dot = end;
            val *got = is_container(x) ? dict_get(x.u.d, p, (size_t)(dot - p)) : NULL;
            x = got ? *got : UNDEF;
            if (dot == end) break;
        }
        list_push(r, l, x.k == V_UNDEF && dflt ? *dflt : x);
    }
    return v_list(l);
}

static val eval_filter(rt *r, const node *e) {
    val v = eval(r, e->a);
    args a;
    eval_args(r, e, &a);
    if (name_eq(e->s, e->n, "safe")) return v;
    if (name_eq(e->s, e->n, "tojson")) {
        sbuf b = {0};
        const val *indent = arg(&a, 99, "indent");
        if (indent && indent->k != V_INT && indent->k != V_NONE)
            rfail(r, e, "tojson: indent must be an integer");
        if (indent && indent->k == V_INT && (indent->u.i < 0 || indent->u.i > 64))
            rfail(r, e, "tojson: indent must be 0 to 64");
        json_style st = {.undef_null = true};
        if (indent && indent->k == V_INT) st.indent = (unsigned)indent->u.i;
        to_json(r, &b, v, st, 0);
        return sb_val(&b);
    }
    if (name_eq(e->s, e->n, "default")) {
        const val *dflt = arg(&a, 0, "default_value"), *boolean = arg(&a, 1, "boolean");
        bool use = v.k == V_UNDEF || (boolean && truthy(*boolean) && !truthy(v));
        return use ? (dflt ? *dflt : v_str("", 0)) : v;
    }
    if (name_eq(e->s, e->n, "join")) return filter_join(r, e, v, &a);
    if (name_eq(e->s, e->n, "selectattr") || name_eq(e->s, e->n, "rejectattr"))
        return filter_select(r, e, v, &a);
    if (name_eq(e->s, e->n, "map")) return filter_map(r, e, v, &a);
    if (name_eq(e->s, e->n, "replace")) {
        const val *from = arg(&a, 0, NULL), *to = arg(&a, 1, NULL);
        if (v.k != V_STR || !from || !to || from->k != V_STR || to->k != V_STR)
            rfail(r, e, "replace: a string and two strings");
        const val *count = arg(&a, 2, "count");
        return str_replace(r, e, v, *from, *to, count && count->k == V_INT ? count->u.i : -1);
    }
    if (v.k == V_LIST) return filter_list(r, e, v);
    return filter_scalar(r, e, v);
}

static bool is_lower_or_upper(val v, bool upper) {
    for (size_t i = 0; v.k == V_STR && i < v.u.str.n; i++) {
        char ch = v.u.str.s[i];
        if (upper ? (ch >= 'a' && ch <= 'z') : (ch >= 'A' && ch <= 'Z')) return false;
    }
    return v.k == V_STR;
}

/* Test t on v; arg is the value equalto/eq compare with (selectattr only). */
static bool apply_test(rt *r, const node *e, const char *t, size_t n, val v, const val *arg) {
    if (name_eq(t, n, "equalto") || name_eq(t, n, "eq")) return arg && strict_eq(v, *arg);
    if (name_eq(t, n, "defined")) return v.k != V_UNDEF;
    if (name_eq(t, n, "undefined")) return v.k == V_UNDEF;
    if (name_eq(t, n, "none")) return v.k == V_NONE;
    if (name_eq(t, n, "string")) return v.k == V_STR;
    if (name_eq(t, n, "number")) return is_num(v);
    if (name_eq(t, n, "integer")) return v.k == V_INT;
    if (name_eq(t, n, "boolean")) return v.k == V_BOOL;
    if (name_eq(t, n, "true") || name_eq(t, n, "false"))
        return v.k == V_BOOL && v.u.b == (t[0] == 't');
    if (name_eq(t, n, "mapping")) return v.k == V_DICT;
    if (name_eq(t, n, "sequence")) return v.k == V_LIST || v.k == V_DICT || v.k == V_STR;
    if (name_eq(t, n, "iterable")) return v.k == V_LIST || v.k == V_STR;
    if (name_eq(t, n, "callable")) return v.k == V_FUNC;
    if (name_eq(t, n, "lower") || name_eq(t, n, "upper")) return is_lower_or_upper(v, t[0] == 'u');
    if (v.k != V_INT) rfail(r, e, "the test '%.*s' needs an integer", (int)n, t);
    return (v.u.i % 2 != 0) == name_eq(t, n, "odd");
}

static bool eval_test(rt *r, const node *e) {
    return apply_test(r, e, e->s, e->n, eval(r, e->a), NULL);
}

/* ---- runtime: operators ----------------------------------------------------------------- */

static val arith(rt *r, const node *e, val a, val b) {
    double x = num_of(a), y = num_of(b);
    bool ints = a.k == V_INT && b.k == V_INT;
    int64_t res;
    switch (e->op) {
    case OP_LT: return v_bool(x < y);
    case OP_GT: return v_bool(x > y);
    case OP_LE: return v_bool(x <= y);
    case OP_GE: return v_bool(x >= y);
    case OP_DIV: return v_float(x / y);
    case OP_ADD:
        if (ints && !__builtin_add_overflow(a.u.i, b.u.i, &res)) return v_int(res);
        return v_float(x + y);
    case OP_SUB:
        if (ints && !__builtin_sub_overflow(a.u.i, b.u.i, &res)) return v_int(res);
        return v_float(x - y);
    case OP_MUL:
        if (ints && !__builtin_mul_overflow(a.u.i, b.u.i, &res)) return v_int(res);
        return v_float(x * y);
    case OP_FLOORDIV:
    case OP_MOD:
        if (y == 0) rfail(r, e, "division by zero");
        if (ints && a.u.i != INT64_MIN) {
            /* JavaScript's % truncates, as C's does; // floors */
            int64_t q = a.u.i / b.u.i, m = a.u.i % b.u.i;
            return v_int(e->op == OP_MOD ? m : q - (m != 0 && ((m < 0) != (b.u.i < 0))));
        }
        return v_float(e->op == OP_MOD ? fmod(x, y) : floor(x / y));
    default: rfail(r, e, "this operator does not apply to numbers");
    }
}

static bool contains(rt *r, const node *e, val needle, val hay) {
    if (hay.k == V_LIST) {
        for (size_t i = 0; i < hay.u.l->n; i++)
            if (strict_eq(needle, hay.u.l->v[i])) return true;
        return false;
    }
    if (needle.k == V_STR && hay.k == V_STR)
        return find_sub(hay.u.str.s, hay.u.str.n, needle.u.str.s, needle.u.str.n) != NULL;
    if (needle.k == V_STR && hay.k == V_DICT)
        return dict_get(hay.u.d, needle.u.str.s, needle.u.str.n) != NULL;
    rfail(r, e, "cannot test whether %s is in %s", kind_name(needle.k), kind_name(hay.k));
}

/* The reference's order of cases: equality, undefined, none, ~, numbers,
 * lists, membership, string concatenation. */
static val eval_bin(rt *r, const node *e) {
    val a = eval(r, e->a);
    if (e->op == OP_AND) return truthy(a) ? eval(r, e->b) : a;
    if (e->op == OP_OR) return truthy(a) ? a : eval(r, e->b);
    val b = eval(r, e->b);
    if (e->op == OP_EQ || e->op == OP_NE) return v_bool(loose_eq(a, b) == (e->op == OP_EQ));
    bool in = e->op == OP_IN || e->op == OP_NOTIN;
    if (in && b.k == V_UNDEF) return v_bool(e->op == OP_NOTIN);
    if (a.k == V_UNDEF || b.k == V_UNDEF || a.k == V_NONE || b.k == V_NONE)
        rfail(r, e, "an operand is %s", a.k == V_UNDEF || b.k == V_UNDEF ? "undefined" : "none");
    if (e->op == OP_CAT ||
        (e->op == OP_ADD && (a.k == V_STR || b.k == V_STR) && !(is_num(a) && is_num(b)) &&
         b.k != V_LIST)) {
        sbuf s = {0};
        concat_part(r, e, &s, a);
        concat_part(r, e, &s, b);
        return sb_val(&s);
    }
    if (is_num(a) && is_num(b) && !in) return arith(r, e, a, b);
    if (a.k == V_LIST && b.k == V_LIST && e->op == OP_ADD) {
        list *l = list_new(r, a.u.l->n + b.u.l->n);
        for (size_t i = 0; i < a.u.l->n; i++) list_push(r, l, a.u.l->v[i]);
        for (size_t i = 0; i < b.u.l->n; i++) list_push(r, l, b.u.l->v[i]);
        return v_list(l);
    }
    if (in) return v_bool(contains(r, e, a, b) == (e->op == OP_IN));
    rfail(r, e, "this operator does not apply to %s and %s", kind_name(a.k), kind_name(b.k));
}

static val eval_sign(rt *r, const node *e) {
    val v = eval(r, e->a);
    if (v.k == V_BOOL) v = v_int(v.u.b);
    if (!is_num(v))
        rfail(r, e, "unary %c does not apply to %s", e->kind == N_NEG ? '-' : '+', kind_name(v.k));
    if (e->kind == N_POS) return v;
    if (v.k == V_INT && v.u.i != INT64_MIN) return v_int(-v.u.i);
    return v_float(-num_of(v));
}

static val eval_collection(rt *r, const node *e) {
    if (e->kind == N_LIST) {
        list *l = list_new(r, e->nkid);
        for (size_t i = 0; i < e->nkid; i++) list_push(r, l, eval(r, e->kid[i]));
        return v_list(l);
    }
    dict *d = dict_new(r);
    for (size_t i = 0; i + 1 < e->nkid; i += 2) {
        val k = eval(r, e->kid[i]);
        if (k.k != V_STR) rfail(r, e->kid[i], "dict keys are strings, not %s", kind_name(k.k));
        dict_set(r, d, k.u.str.s, k.u.str.n, eval(r, e->kid[i + 1]));
    }
    return (val){.k = V_DICT, .u.d = d};
}

static val eval(rt *r, const node *e) {
    step(r, e);
    switch (e->kind) {
    case N_STR: return v_str(e->s, e->n);
    case N_INT: return v_int(e->i);
    case N_FLOAT: return v_float(e->f);
    case N_NAME: return lookup(r, e);
    case N_LIST:
    case N_DICT: return eval_collection(r, e);
    case N_ATTR: return member(r, e, eval(r, e->a), v_str(e->s, e->n));
    case N_INDEX: {
        val obj = eval(r, e->a);
        return member(r, e, obj, eval(r, e->b));
    }
    case N_SLICE: return eval_slice(r, e);
    case N_CALL: return eval_call(r, e);
    case N_FILTER: return eval_filter(r, e);
    case N_TEST: return v_bool(eval_test(r, e) != e->negate);
    case N_BIN: return eval_bin(r, e);
    case N_NOT: return v_bool(!truthy(eval(r, e->a)));
    case N_NEG:
    case N_POS: return eval_sign(r, e);
    case N_COND: return truthy(eval(r, e->b)) ? eval(r, e->a) : eval(r, e->c);
    default: rfail(r, e, "internal: node %d is not an expression", (int)e->kind);
    }
}

/* ---- runtime: statements ---------------------------------------------------------------- */

static void exec_body(rt *r, node *const *body, size_t n);

static val loop_object(rt *r, const list *items, size_t i) {
    dict *d = dict_new(r);
    size_t n = items->n;
    dict_set(r, d, "index", 5, v_int((int64_t)i + 1));
    dict_set(r, d, "index0", 6, v_int((int64_t)i));
    dict_set(r, d, "revindex", 8, v_int((int64_t)(n - i)));
    dict_set(r, d, "revindex0", 9, v_int((int64_t)(n - i - 1)));
    dict_set(r, d, "first", 5, v_bool(i == 0));
    dict_set(r, d, "last", 4, v_bool(i + 1 == n));
    dict_set(r, d, "length", 6, v_int((int64_t)n));
    dict_set(r, d, "previtem", 8, i > 0 ? items->v[i - 1] : UNDEF);
    dict_set(r, d, "nextitem", 8, i + 1 < n ? items->v[i + 1] : UNDEF);
    return (val){.k = V_DICT, .u.d = d};
}

static void bind_target(rt *r, const node *target, val item) {
    if (target->kind == N_NAME) {
        scope_set(r, r->sc, target->s, target->n, item);
        return;
    }
    if (item.k != V_LIST || item.u.l->n != target->nkid)
        rfail(r, target, "cannot unpack %s into %zu names", kind_name(item.k), target->nkid);
    for (size_t i = 0; i < target->nkid; i++)
        scope_set(r, r->sc, target->kid[i]->s, target->kid[i]->n, item.u.l->v[i]);
}

/* One scope for the whole loop, as the reference has: a `set` in the body
 * is seen by later iterations and not after the loop. */
static void exec_for(rt *r, const node *s) {
    scope sc = {.parent = r->sc, .head = NULL};
    r->sc = &sc;
    val it = eval(r, s->b);
    list *items;
    if (it.k == V_LIST) {
        items = it.u.l;
    } else if (it.k == V_DICT) {
        items = dict_items(r, it.u.d, 1).u.l;
    } else {
        rfail(r, s, "cannot loop over %s", kind_name(it.k));
    }
    bool completed = false; /* an iteration ran to its end: the reference's else rule */
    for (size_t i = 0; i < items->n; i++) {
        scope_set(r, &sc, "loop", 4, loop_object(r, items, i));
        bind_target(r, s->a, items->v[i]);
        exec_body(r, s->kid, s->nkid);
        nkind ctl = r->ctl;
        r->ctl = N_TEXT;
        if (ctl == N_BREAK) break;
        if (ctl == N_CONTINUE) continue;
        completed = true;
    }
    if (!completed) exec_body(r, s->alt, s->nalt);
    PD_ASSERT(r->sc == &sc); /* bodies restore the scopes they push */
    r->sc = sc.parent;
}

static void exec_set(rt *r, const node *s) {
    val v = eval(r, s->b);
    if (s->a->kind == N_NAME) {
        scope_set(r, r->sc, s->a->s, s->a->n, v);
        return;
    }
    val ns = eval(r, s->a->a);
    if (ns.k != V_NS)
        rfail(r, s, "cannot set an attribute of %s (only of a namespace)", kind_name(ns.k));
    dict_set(r, ns.u.d, s->a->s, s->a->n, v);
}

static void exec(rt *r, const node *s) {
    step(r, s);
    switch (s->kind) {
    case N_TEXT: out_append(r, s->s, s->n); return;
    case N_OUT: {
        val v = eval(r, s->a);
        if (v.k == V_STR) {
            out_append(r, v.u.str.s, v.u.str.n);
        } else {
            sbuf b = {0};
            display(r, s, &b, v);
            out_append(r, b.s, b.n);
        }
        return;
    }
    case N_IF:
        if (truthy(eval(r, s->a))) {
            exec_body(r, s->kid, s->nkid);
        } else {
            exec_body(r, s->alt, s->nalt);
        }
        return;
    case N_FOR: exec_for(r, s); return;
    case N_SET: exec_set(r, s); return;
    case N_BREAK:
    case N_CONTINUE: r->ctl = s->kind; return;
    default: rfail(r, s, "internal: node %d is not a statement", (int)s->kind);
    }
}

/* Stops at a break or continue, which the enclosing loop takes. */
static void exec_body(rt *r, node *const *body, size_t n) {
    for (size_t i = 0; i < n && r->ctl == N_TEXT; i++) exec(r, body[i]);
}

static void render_guarded(rt *r, const pd_chat_template *t, const json_t *ctx, scope *root) {
    const char *key;
    const json_t *v;
    if (ctx) {
        json_object_foreach((json_t *)ctx, key, v) {
            scope_set(r, root, key, strlen(key), from_json(r, v, 0));
        }
    }
    exec_body(r, t->body, t->nbody);
    PD_ASSERT(r->sc == root);
    out_append(r, "", 1); /* the NUL, not counted in out_len */
    r->out_len--;
}

pd_err pd_chat_template_render(const pd_chat_template *t, const json_t *ctx, char **out,
                               size_t *out_len, char *msg, size_t msg_cap) {
    PD_ASSERT(t && out && out_len);
    *out = NULL;
    *out_len = 0;
    if (ctx && !json_is_object(ctx))
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID,
                         "chat template: the context is not an object");
    rt *r = calloc(1, sizeof(*r));
    if (!r) return pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "chat template: out of memory");
    r->f = (failer){.msg = msg, .msg_cap = msg_cap};
    scope root = {0};
    r->sc = &root;
    pd_err err = PD_OK;
    if (setjmp(r->f.jb) == 0) {
        render_guarded(r, t, ctx, &root);
    } else {
        err = r->f.err;
    }
    arena_free(&r->ar);
    if (err) {
        free(r->out);
    } else {
        PD_ASSERT(r->out[r->out_len] == 0);
        *out = r->out;
        *out_len = r->out_len;
    }
    free(r);
    return err;
}
