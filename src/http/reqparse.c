/*
 * reqparse.c — one connection's request parsing: bytes in, a request or a
 * refusal out, no I/O (the fuzz target drives it alone).
 *
 * llhttp is built in strict mode with every lenient flag off, and does the
 * grammar: methods, the request line, header tokens, Content-Length and
 * chunked framing. On top of it, callbacks enforce what llhttp leaves to the
 * server, refusing with a status and a message a person can read:
 *
 *   431  the header block over header_bytes_max bytes or headers_max fields
 *   413  a body over body_bytes_max: from Content-Length before a byte of it
 *        is read, or as a chunked body grows (chunk extensions and trailers
 *        count towards it, and are not kept)
 *   505  any version but HTTP/1.0 and 1.1 (0.9 and 2.0 parse; 1.2 does not)
 *   400  anything llhttp refuses (its reason quoted); two Content-Length
 *        headers, even equal; Transfer-Encoding with Content-Length, or in
 *        HTTP/1.0; two Host headers, or HTTP/1.1 without one; a target that
 *        is not a path; a path holding a percent-encoded NUL (a raw NUL
 *        llhttp refuses)
 *
 * The header limit is exact without counting inside llhttp: while the block
 * is incomplete, llhttp is given at most the bytes the limit has left, and
 * on_headers_complete pauses it, so the position where it stopped is the
 * block's length. on_message_complete pauses too: one request at a time, the
 * next one's bytes stay with the caller until the answer has ended (S4).
 *
 * The arena bound: every byte stored (target, names, values) is a byte of
 * the block, and each adds at most one NUL, so header_bytes_max plus two
 * NULs per field plus one always fits; appends assert it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "server_internal.h"

static http_reqparse *parser_of(llhttp_t *ll) { return ll->data; }

/* Records a refusal; the callback returns the -1 this gives, which stops
 * llhttp with some error code the feed ignores in favour of ours. */
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static int
refuse(http_reqparse *p, unsigned status, const char *fmt, ...) {
    if (!p->failed) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(p->err_msg, sizeof p->err_msg, fmt, ap);
        va_end(ap);
        p->err_status = status;
        p->failed = true;
    }
    return -1;
}

static void arena_put(http_reqparse *p, const char *at, size_t n) {
    PD_ASSERT(p->head_len + n < p->head_cap);
    memcpy(p->head + p->head_len, at, n);
    p->head_len += (uint32_t)n;
}

static void arena_end(http_reqparse *p) {
    PD_ASSERT(p->head_len < p->head_cap);
    p->head[p->head_len++] = '\0';
}

/* Bytes of the body phase that are not body (chunk extensions, trailers)
 * count towards the body's limit, so they too are bounded. */
static int body_budget(http_reqparse *p, size_t n) {
    PD_ASSERT(p->body_seen <= p->lim.body_bytes_max);
    if (n > p->lim.body_bytes_max - p->body_seen)
        return refuse(p, 413, "request body over the limit of %llu bytes",
                      (unsigned long long)p->lim.body_bytes_max);
    p->body_seen += n;
    return 0;
}

static int on_message_begin(llhttp_t *ll) {
    http_reqparse *p = parser_of(ll);
    p->head_len = p->target_len = p->headers_n = 0;
    p->body.len = 0;
    p->body_seen = 0;
    p->content_lengths = p->transfer_encodings = p->hosts = 0;
    p->expect_continue = p->keep_alive = false;
    return 0;
}

static int on_url(llhttp_t *ll, const char *at, size_t n) {
    arena_put(parser_of(ll), at, n);
    return 0;
}

static int on_url_complete(llhttp_t *ll) {
    http_reqparse *p = parser_of(ll);
    p->target_len = p->head_len;
    arena_end(p);
    p->mark = p->head_len;
    if (p->head[0] != '/') return refuse(p, 400, "the request target must be a path");
    for (const char *c = p->head; *c && *c != '?'; c++)
        if (c[0] == '%' && c[1] == '0' && c[2] == '0')
            return refuse(p, 400, "a percent-encoded NUL (%%00) in the path");
    return 0;
}

static int on_header_field(llhttp_t *ll, const char *at, size_t n) {
    http_reqparse *p = parser_of(ll);
    if (p->in_body) return body_budget(p, n);
    if (p->headers_n == p->lim.headers_max)
        return refuse(p, 431, "more than %u header fields", p->lim.headers_max);
    arena_put(p, at, n);
    return 0;
}

/* The framing headers two parsers could read differently are counted as
 * their names complete, so the refusal names the problem before llhttp's
 * own (less specific) check. */
static int count_framing(http_reqparse *p, const char *name) {
    if (!strcasecmp(name, "content-length") && ++p->content_lengths > 1)
        return refuse(p, 400, "two Content-Length headers");
    if (!strcasecmp(name, "transfer-encoding")) p->transfer_encodings++;
    if (p->transfer_encodings && p->content_lengths)
        return refuse(p, 400, "Transfer-Encoding together with Content-Length");
    if (!strcasecmp(name, "host") && ++p->hosts > 1) return refuse(p, 400, "two Host headers");
    return 0;
}

static int on_header_field_complete(llhttp_t *ll) {
    http_reqparse *p = parser_of(ll);
    if (p->in_body) return 0;
    arena_end(p);
    http_header *h = &p->headers[p->headers_n];
    h->name = p->mark;
    h->value = p->head_len;
    return count_framing(p, p->head + h->name);
}

static int on_header_value(llhttp_t *ll, const char *at, size_t n) {
    http_reqparse *p = parser_of(ll);
    if (p->in_body) return body_budget(p, n);
    arena_put(p, at, n);
    return 0;
}

static int on_header_value_complete(llhttp_t *ll) {
    http_reqparse *p = parser_of(ll);
    if (p->in_body) return 0;
    http_header *h = &p->headers[p->headers_n];
    /* llhttp drops the leading whitespace of a value but keeps the trailing. */
    while (p->head_len > h->value &&
           (p->head[p->head_len - 1] == ' ' || p->head[p->head_len - 1] == '\t'))
        p->head_len--;
    arena_end(p);
    if (!strcasecmp(p->head + h->name, "expect") && !strcasecmp(p->head + h->value, "100-continue"))
        p->expect_continue = true;
    p->headers_n++;
    p->mark = p->head_len;
    return 0;
}

static int on_headers_complete(llhttp_t *ll) {
    http_reqparse *p = parser_of(ll);
    unsigned major = ll->http_major, minor = ll->http_minor;
    if (major != 1 || minor > 1)
        return refuse(p, 505, "HTTP/%u.%u is not supported (only 1.0 and 1.1)", major, minor);
    if (minor == 1 && p->hosts == 0) return refuse(p, 400, "an HTTP/1.1 request without Host");
    /* HTTP/1.0 has no transfer codings: a 1.0 hop before us may not have read
     * the body as chunked, which is the smuggling RFC 9112 6.1 warns of. */
    if (minor == 0 && p->transfer_encodings)
        return refuse(p, 400, "Transfer-Encoding in an HTTP/1.0 request");
    if ((ll->flags & F_CONTENT_LENGTH) && ll->content_length > p->lim.body_bytes_max)
        return refuse(p, 413, "request body of %llu bytes is over the limit of %llu bytes",
                      (unsigned long long)ll->content_length,
                      (unsigned long long)p->lim.body_bytes_max);
    return HPE_PAUSED;
}

static int on_body(llhttp_t *ll, const char *at, size_t n) {
    http_reqparse *p = parser_of(ll);
    if (body_budget(p, n) != 0) return -1;
    if (!http_buf_append(&p->body, at, n)) return refuse(p, 503, "out of memory for the body");
    return 0;
}

static int on_chunk_extension(llhttp_t *ll, const char *at, size_t n) {
    return body_budget(parser_of(ll), n);
}

static int on_message_complete(llhttp_t *ll) {
    http_reqparse *p = parser_of(ll);
    p->keep_alive = llhttp_should_keep_alive(ll) && !ll->upgrade;
    return HPE_PAUSED;
}

static const llhttp_settings_t settings = {
    .on_message_begin = on_message_begin,
    .on_url = on_url,
    .on_url_complete = on_url_complete,
    .on_header_field = on_header_field,
    .on_header_field_complete = on_header_field_complete,
    .on_header_value = on_header_value,
    .on_header_value_complete = on_header_value_complete,
    .on_headers_complete = on_headers_complete,
    .on_body = on_body,
    .on_chunk_extension_name = on_chunk_extension,
    .on_chunk_extension_value = on_chunk_extension,
    .on_message_complete = on_message_complete,
};

pd_err http_reqparse_init(http_reqparse *p, const http_limits *lim) {
    PD_ASSERT(lim->header_bytes_max > 0 && lim->headers_max > 0);
    memset(p, 0, sizeof *p);
    p->lim = *lim;
    p->head_cap = lim->header_bytes_max + 2 * lim->headers_max + 2;
    p->head = malloc(p->head_cap);
    p->headers = calloc(lim->headers_max, sizeof *p->headers);
    if (!p->head || !p->headers) {
        http_reqparse_free(p);
        return PD_ERR_NOMEM;
    }
    llhttp_init(&p->ll, HTTP_REQUEST, &settings);
    p->ll.data = p;
    return PD_OK;
}

void http_reqparse_free(http_reqparse *p) {
    free(p->head);
    free(p->headers);
    http_buf_free(&p->body);
    memset(p, 0, sizeof *p);
}

bool http_reqparse_started(const http_reqparse *p) { return p->header_seen > 0 || p->in_body; }

/* llhttp's own refusals: its reason quoted; a version it cannot read is 505. */
static void refuse_llhttp(http_reqparse *p, llhttp_errno_t e) {
    const char *why = llhttp_get_error_reason(&p->ll);
    if (!why) why = llhttp_errno_name(e);
    if (e == HPE_INVALID_VERSION) refuse(p, 505, "unsupported HTTP version: %s", why);
    else if (e == HPE_PAUSED_UPGRADE) refuse(p, 400, "protocol upgrades are not supported");
    else refuse(p, 400, "malformed request: %s", why);
}

/* The header phase: at most the bytes the limit has left. */
static size_t feed_head(http_reqparse *p, const char *data, size_t len, http_feed *ev) {
    size_t give = PD_MIN(len, (size_t)(p->lim.header_bytes_max - p->header_seen));
    llhttp_errno_t e = llhttp_execute(&p->ll, data, give);
    size_t took = e == HPE_OK ? give : (size_t)(llhttp_get_error_pos(&p->ll) - data);
    PD_ASSERT(took <= give);
    p->header_seen += (uint32_t)took;
    if (p->failed || (e != HPE_OK && e != HPE_PAUSED)) {
        if (!p->failed) refuse_llhttp(p, e);
        *ev = HTTP_FEED_ERROR;
    } else if (e == HPE_PAUSED) {
        p->paused = p->in_body = true;
        *ev = HTTP_FEED_HEADERS;
    } else if (p->header_seen >= p->lim.header_bytes_max) {
        refuse(p, 431, "the header block is over the limit of %u bytes", p->lim.header_bytes_max);
        *ev = HTTP_FEED_ERROR;
    } else {
        *ev = HTTP_FEED_MORE;
    }
    return took;
}

static size_t feed_body(http_reqparse *p, const char *data, size_t len, http_feed *ev) {
    llhttp_errno_t e = llhttp_execute(&p->ll, data, len);
    size_t took = e == HPE_OK ? len : (size_t)(llhttp_get_error_pos(&p->ll) - data);
    PD_ASSERT(took <= len);
    if (p->failed || (e != HPE_OK && e != HPE_PAUSED)) {
        if (!p->failed) refuse_llhttp(p, e);
        *ev = HTTP_FEED_ERROR;
    } else if (e == HPE_PAUSED) {
        p->paused = true;
        p->in_body = false;
        p->header_seen = 0;
        *ev = HTTP_FEED_DONE;
    } else {
        *ev = HTTP_FEED_MORE;
    }
    return took;
}

size_t http_reqparse_feed(http_reqparse *p, const char *data, size_t len, http_feed *ev) {
    PD_ASSERT(!p->failed);
    PD_ASSERT(data != NULL || len == 0);
    static const char nothing[1] = "";
    if (!data) data = nothing;
    if (p->paused) {
        llhttp_resume(&p->ll);
        p->paused = false;
    }
    return p->in_body ? feed_body(p, data, len, ev) : feed_head(p, data, len, ev);
}

static int hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Percent-decodes the path part of the target into out (n + 1 bytes); a '%'
 * not followed by two hex digits stays as it is. %00 was refused, so the
 * result holds no NUL before its end. */
static void decode_path(const char *in, size_t n, char *out) {
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        int hi = in[i] == '%' && i + 2 < n ? hex_value(in[i + 1]) : -1;
        int lo = hi >= 0 ? hex_value(in[i + 2]) : -1;
        if (lo >= 0) {
            out[o++] = (char)(hi * 16 + lo);
            i += 2;
        } else {
            out[o++] = in[i];
        }
    }
    out[o] = '\0';
    PD_ASSERT(o <= n && strlen(out) == o);
}

static void take_body(http_reqparse *p, pd_http_req *r) {
    r->body_len = p->body.len;
    if (p->body.len > 0 && http_buf_append(&p->body, "", 1)) {
        r->body = p->body.data;
        p->body = (http_buf){0};
    }
}

pd_http_req *http_reqparse_take(http_reqparse *p) {
    PD_ASSERT(!p->failed && p->target_len > 0);
    size_t hdrs = (size_t)p->headers_n * sizeof(http_header);
    pd_http_req *r = calloc(1, sizeof *r + hdrs + p->head_len + p->target_len + 1);
    if (!r) return NULL;
    char *mem = (char *)(r + 1);
    memcpy(mem, p->headers, hdrs);
    char *head = memcpy(mem + hdrs, p->head, p->head_len);
    char *path = head + p->head_len;
    const char *q = memchr(head, '?', p->target_len);
    size_t path_len = q ? (size_t)(q - head) : p->target_len;
    decode_path(head, path_len, path);
    *r = (pd_http_req){.method = llhttp_method_name(llhttp_get_method(&p->ll)),
                       .path = path,
                       .query = q ? q + 1 : head + p->target_len,
                       .head = head,
                       .headers = (const http_header *)mem,
                       .headers_n = p->headers_n,
                       .version_minor = p->ll.http_minor,
                       .head_only = llhttp_get_method(&p->ll) == HTTP_HEAD,
                       .keep_alive = p->keep_alive};
    take_body(p, r);
    if (r->body_len > 0 && !r->body) {
        free(r);
        return NULL;
    }
    atomic_init(&r->refs, 1);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->called, NULL);
    return r;
}
