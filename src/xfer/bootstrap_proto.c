/*
 * bootstrap_proto.c — encoders and decoders of the bootstrap channel's
 * messages (layouts in bootstrap_proto.h and docs/bootstrap-protocol.md).
 *
 * Every decoder follows one rule: compute the exact length the fixed fields
 * announce, compare it with the payload length, and only then hand out
 * pointers into the payload. Reserved fields must be zero, so a version-1
 * node never silently ignores something a later version meant.
 */
#include "bootstrap_proto.h"

#include <string.h>

#include <sodium.h>

/* ---- little-endian helpers ---------------------------------------------------- */

uint16_t bp_get_u16(const uint8_t *p) { return (uint16_t)(p[0] | (uint16_t)p[1] << 8); }

uint32_t bp_get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

uint64_t bp_get_u64(const uint8_t *p) {
    return (uint64_t)bp_get_u32(p) | (uint64_t)bp_get_u32(p + 4) << 32;
}

void bp_put_u16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

void bp_put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

void bp_put_u64(uint8_t *p, uint64_t v) {
    bp_put_u32(p, (uint32_t)v);
    bp_put_u32(p + 4, (uint32_t)(v >> 32));
}

/* ---- names ------------------------------------------------------------------- */

const char *bp_type_name(uint32_t type) {
    static const char *const names[BP__TYPE_COUNT] = {
        [BP_HELLO] = "HELLO",     [BP_HELLO_OK] = "HELLO_OK", [BP_DEST] = "DEST",
        [BP_DEST_OK] = "DEST_OK", [BP_START] = "START",       [BP_DONE] = "DONE",
        [BP_ABORT] = "ABORT",     [BP_ACK] = "ACK",           [BP_PING] = "PING",
        [BP_ERROR] = "ERROR",     [BP_AUTH] = "AUTH",         [BP_CHALLENGE] = "CHALLENGE",
    };
    return type < BP__TYPE_COUNT && names[type] ? names[type] : "UNKNOWN";
}

const char *bp_code_name(uint32_t code) {
    switch ((bp_code)code) {
    case BP_E_MALFORMED: return "malformed";
    case BP_E_VERSION: return "version";
    case BP_E_AUTH: return "auth";
    case BP_E_TOO_BIG: return "too_big";
    case BP_E_UNEXPECTED: return "unexpected";
    case BP_E_ROOM_UNKNOWN: return "room_unknown";
    case BP_E_ROOM_DUPLICATE: return "room_duplicate";
    case BP_E_DEST_INVALID: return "dest_invalid";
    case BP_E_MISMATCH: return "mismatch";
    case BP_E_BUSY: return "busy";
    case BP_E_UCX: return "ucx";
    case BP_E_TIMEOUT: return "timeout";
    }
    return "unknown";
}

/* ---- header ------------------------------------------------------------------- */

/* Largest payload each type may carry; 0 for unknown types. */
static uint32_t payload_max(uint32_t type) {
    switch ((bp_type)type) {
    case BP_HELLO: return BP_HELLO_MAX;
    case BP_HELLO_OK: return 16;
    case BP_DEST: return BP_PAYLOAD_MAX;
    case BP_DEST_OK:
    case BP_START:
    case BP_DONE:
    case BP_ABORT:
    case BP_ACK: return BP_ROOM_MSG_BYTES;
    case BP_PING: return 0;
    case BP_ERROR: return 16 + BP_ERROR_TEXT_MAX;
    case BP_AUTH: return BP_NONCE_BYTES;
    case BP_CHALLENGE: return BP_NONCE_BYTES + BP_PROOF_BYTES;
    case BP__TYPE_COUNT: break;
    }
    return 0;
}

bool bp_type_for_role(uint32_t type, bool prefill) {
    switch ((bp_type)type) {
    case BP_AUTH:
    case BP_HELLO:
    case BP_DEST: return prefill;
    case BP_CHALLENGE:
    case BP_HELLO_OK:
    case BP_DEST_OK:
    case BP_START:
    case BP_DONE:
    case BP_ACK: return !prefill;
    case BP_ABORT:
    case BP_PING:
    case BP_ERROR: return true;
    case BP__TYPE_COUNT: break;
    }
    return false;
}

pd_err bp_header_check(const uint8_t *buf, bp_header *out, bp_code *code) {
    bp_header h = {
        .magic = bp_get_u32(buf),
        .version = bp_get_u16(buf + 4),
        .type = bp_get_u16(buf + 6),
        .flags = bp_get_u32(buf + 8),
        .length = bp_get_u32(buf + 12),
    };
    *out = h;
    if (h.magic != BP_MAGIC) {
        *code = BP_E_MALFORMED;
        return PD_ERR_PARSE;
    }
    if (h.version < BP_VERSION_MIN || h.version > BP_VERSION) {
        *code = BP_E_VERSION;
        return PD_ERR_PARSE;
    }
    if (h.flags != 0) {
        *code = BP_E_MALFORMED;
        return PD_ERR_PARSE;
    }
    if (h.type == 0 || h.type >= BP__TYPE_COUNT) {
        *code = BP_E_UNEXPECTED;
        return PD_ERR_PARSE;
    }
    if (h.length > payload_max(h.type)) {
        *code = BP_E_TOO_BIG;
        return PD_ERR_TOOBIG;
    }
    return PD_OK;
}

void bp_header_write(uint8_t *buf, bp_type type, uint32_t length) {
    bp_put_u32(buf, BP_MAGIC);
    bp_put_u16(buf + 4, BP_VERSION);
    bp_put_u16(buf + 6, (uint16_t)type);
    bp_put_u32(buf + 8, 0);
    bp_put_u32(buf + 12, length);
}

/* ---- AUTH, CHALLENGE, proofs ------------------------------------------------------ */

static const char LABEL_PREFILL[] = "pdserve bootstrap v2: prefill proof";
static const char LABEL_DECODE[] = "pdserve bootstrap v2: decode proof";

static void mac_begin(crypto_auth_hmacsha256_state *st, const bp_auth *a, const char *label,
                      const uint8_t *first, const uint8_t *second) {
    static const uint8_t no_key[1];
    crypto_auth_hmacsha256_init(st, a->key_len ? a->key : no_key, a->key_len);
    crypto_auth_hmacsha256_update(st, (const uint8_t *)label, strlen(label) + 1);
    crypto_auth_hmacsha256_update(st, first, BP_NONCE_BYTES);
    crypto_auth_hmacsha256_update(st, second, BP_NONCE_BYTES);
}

void bp_prefill_proof(const bp_auth *a, uint8_t out[BP_PROOF_BYTES]) {
    crypto_auth_hmacsha256_state st;
    mac_begin(&st, a, LABEL_PREFILL, a->nonce_decode, a->nonce_prefill);
    crypto_auth_hmacsha256_final(&st, out);
}

bool bp_proof_equal(const uint8_t a[BP_PROOF_BYTES], const uint8_t b[BP_PROOF_BYTES]) {
    return sodium_memcmp(a, b, BP_PROOF_BYTES) == 0;
}

size_t bp_auth_write(uint8_t *out, size_t cap, const uint8_t nonce[BP_NONCE_BYTES]) {
    if (cap < BP_HEADER_BYTES + BP_NONCE_BYTES) return 0;
    bp_header_write(out, BP_AUTH, BP_NONCE_BYTES);
    memcpy(out + BP_HEADER_BYTES, nonce, BP_NONCE_BYTES);
    return BP_HEADER_BYTES + BP_NONCE_BYTES;
}

pd_err bp_auth_read(const uint8_t *p, uint32_t len, uint8_t nonce[BP_NONCE_BYTES]) {
    if (len != BP_NONCE_BYTES) return PD_ERR_PARSE;
    memcpy(nonce, p, BP_NONCE_BYTES);
    return PD_OK;
}

size_t bp_challenge_write(uint8_t *out, size_t cap, const uint8_t nonce[BP_NONCE_BYTES],
                          const uint8_t proof[BP_PROOF_BYTES]) {
    if (cap < BP_HEADER_BYTES + BP_NONCE_BYTES + BP_PROOF_BYTES) return 0;
    bp_header_write(out, BP_CHALLENGE, BP_NONCE_BYTES + BP_PROOF_BYTES);
    memcpy(out + BP_HEADER_BYTES, nonce, BP_NONCE_BYTES);
    memcpy(out + BP_HEADER_BYTES + BP_NONCE_BYTES, proof, BP_PROOF_BYTES);
    return BP_HEADER_BYTES + BP_NONCE_BYTES + BP_PROOF_BYTES;
}

pd_err bp_challenge_read(const uint8_t *p, uint32_t len, uint8_t nonce[BP_NONCE_BYTES],
                         uint8_t proof[BP_PROOF_BYTES]) {
    if (len != BP_NONCE_BYTES + BP_PROOF_BYTES) return PD_ERR_PARSE;
    memcpy(nonce, p, BP_NONCE_BYTES);
    memcpy(proof, p + BP_NONCE_BYTES, BP_PROOF_BYTES);
    return PD_OK;
}

/* ---- HELLO -------------------------------------------------------------------- */

#define HELLO_FIXED 24u
#define HELLO_REGION 24u
#define HELLO_PROOF (HELLO_FIXED + BP_REG_COUNT * HELLO_REGION)
#define HELLO_HEAD (HELLO_PROOF + BP_PROOF_BYTES)

void bp_hello_proof(const bp_auth *a, const uint8_t *payload, uint32_t len,
                    uint8_t out[BP_PROOF_BYTES]) {
    PD_ASSERT(len >= HELLO_HEAD);
    static const uint8_t zero[BP_PROOF_BYTES];
    crypto_auth_hmacsha256_state st;
    mac_begin(&st, a, LABEL_DECODE, a->nonce_prefill, a->nonce_decode);
    crypto_auth_hmacsha256_update(&st, payload, HELLO_PROOF);
    crypto_auth_hmacsha256_update(&st, zero, BP_PROOF_BYTES);
    crypto_auth_hmacsha256_update(&st, payload + HELLO_HEAD, len - HELLO_HEAD);
    crypto_auth_hmacsha256_final(&st, out);
}

bool bp_hello_verify(const bp_auth *a, const uint8_t *payload, uint32_t len) {
    if (len < HELLO_HEAD) return false;
    uint8_t want[BP_PROOF_BYTES];
    bp_hello_proof(a, payload, len, want);
    return bp_proof_equal(want, payload + HELLO_PROOF);
}

size_t bp_hello_write(uint8_t *out, size_t cap, const bp_hello *h, const bp_auth *a) {
    if (h->worker_addr_len > BP_WORKER_ADDR_MAX) return 0;
    size_t len = HELLO_HEAD + h->worker_addr_len;
    for (int r = 0; r < BP_REG_COUNT; r++) {
        if (h->region[r].rkey_len > BP_RKEY_MAX) return 0;
        len += h->region[r].rkey_len;
    }
    if (len > BP_HELLO_MAX || BP_HEADER_BYTES + len > cap) return 0;
    uint8_t *p = out + BP_HEADER_BYTES;
    memset(p, 0, HELLO_HEAD);
    bp_put_u64(p, h->node_id);
    bp_put_u32(p + 8, h->page_size);
    bp_put_u32(p + 12, h->meta_row_bytes);
    bp_put_u16(p + 18, h->worker_addr_len);
    for (int r = 0; r < BP_REG_COUNT; r++) {
        uint8_t *q = p + HELLO_FIXED + r * HELLO_REGION;
        bp_put_u64(q, h->region[r].base);
        bp_put_u64(q + 8, h->region[r].unit_bytes);
        bp_put_u32(q + 16, h->region[r].units);
        bp_put_u16(q + 20, h->region[r].rkey_len);
    }
    uint8_t *v = p + HELLO_HEAD;
    if (h->worker_addr_len) memcpy(v, h->worker_addr, h->worker_addr_len);
    v += h->worker_addr_len;
    for (int r = 0; r < BP_REG_COUNT; r++) {
        if (h->region[r].rkey_len) memcpy(v, h->region[r].rkey, h->region[r].rkey_len);
        v += h->region[r].rkey_len;
    }
    bp_hello_proof(a, p, (uint32_t)len, p + HELLO_PROOF);
    bp_header_write(out, BP_HELLO, (uint32_t)len);
    return BP_HEADER_BYTES + len;
}

/* A region is either absent (no units, no key) or complete, and its byte
 * range must not wrap the address space. */
static pd_err region_read(const uint8_t *q, bp_region *g) {
    g->base = bp_get_u64(q);
    g->unit_bytes = bp_get_u64(q + 8);
    g->units = bp_get_u32(q + 16);
    g->rkey_len = bp_get_u16(q + 20);
    if (bp_get_u16(q + 22) != 0 || g->rkey_len > BP_RKEY_MAX) return PD_ERR_PARSE;
    if ((g->units == 0) != (g->rkey_len == 0)) return PD_ERR_PARSE;
    if (g->units &&
        (g->unit_bytes == 0 || g->unit_bytes > UINT64_MAX / g->units ||
         g->base > UINT64_MAX - g->unit_bytes * g->units))
        return PD_ERR_PARSE;
    return PD_OK;
}

pd_err bp_hello_read(const uint8_t *p, uint32_t len, bp_hello *out) {
    if (len < HELLO_HEAD) return PD_ERR_PARSE;
    memset(out, 0, sizeof(*out));
    out->node_id = bp_get_u64(p);
    out->page_size = bp_get_u32(p + 8);
    out->meta_row_bytes = bp_get_u32(p + 12);
    out->worker_addr_len = bp_get_u16(p + 18);
    if (bp_get_u16(p + 16) != 0 || bp_get_u32(p + 20) != 0) return PD_ERR_PARSE;
    if (out->worker_addr_len > BP_WORKER_ADDR_MAX || out->worker_addr_len == 0) return PD_ERR_PARSE;
    size_t want = HELLO_HEAD + (size_t)out->worker_addr_len;
    for (int r = 0; r < BP_REG_COUNT; r++) {
        if (region_read(p + HELLO_FIXED + r * HELLO_REGION, &out->region[r]) != PD_OK)
            return PD_ERR_PARSE;
        want += out->region[r].rkey_len;
    }
    if (want != len) return PD_ERR_PARSE;
    out->proof = p + HELLO_PROOF;
    const uint8_t *v = p + HELLO_HEAD;
    out->worker_addr = v;
    v += out->worker_addr_len;
    for (int r = 0; r < BP_REG_COUNT; r++) {
        out->region[r].rkey = out->region[r].rkey_len ? v : NULL;
        v += out->region[r].rkey_len;
    }
    return PD_OK;
}

/* ---- HELLO_OK ------------------------------------------------------------------- */

size_t bp_hello_ok_write(uint8_t *out, size_t cap, uint64_t node_id, uint32_t page_size) {
    if (cap < BP_HEADER_BYTES + 16) return 0;
    bp_header_write(out, BP_HELLO_OK, 16);
    bp_put_u64(out + 16, node_id);
    bp_put_u32(out + 24, page_size);
    bp_put_u32(out + 28, 0);
    return BP_HEADER_BYTES + 16;
}

pd_err bp_hello_ok_read(const uint8_t *p, uint32_t len, uint64_t *node_id, uint32_t *page_size) {
    if (len != 16 || bp_get_u32(p + 12) != 0) return PD_ERR_PARSE;
    *node_id = bp_get_u64(p);
    *page_size = bp_get_u32(p + 8);
    return PD_OK;
}

/* ---- DEST ------------------------------------------------------------------------ */

size_t bp_dest_write(uint8_t *out, size_t cap, uint64_t room, uint32_t prompt_tokens,
                     uint32_t cached_tokens, uint32_t mamba_slot, uint32_t meta_row,
                     const uint32_t *pages, uint32_t n_pages) {
    if (n_pages > BP_DEST_PAGES_MAX) return 0;
    size_t len = BP_DEST_FIXED + 4u * (size_t)n_pages;
    if (BP_HEADER_BYTES + len > cap) return 0;
    bp_header_write(out, BP_DEST, (uint32_t)len);
    uint8_t *p = out + BP_HEADER_BYTES;
    bp_put_u64(p, room);
    bp_put_u32(p + 8, prompt_tokens);
    bp_put_u32(p + 12, cached_tokens);
    bp_put_u32(p + 16, mamba_slot);
    bp_put_u32(p + 20, meta_row);
    bp_put_u32(p + 24, n_pages);
    bp_put_u32(p + 28, 0);
    for (uint32_t i = 0; i < n_pages; i++) bp_put_u32(p + BP_DEST_FIXED + 4u * i, pages[i]);
    return BP_HEADER_BYTES + len;
}

pd_err bp_dest_read(const uint8_t *p, uint32_t len, bp_dest *out) {
    if (len < BP_DEST_FIXED) return PD_ERR_PARSE;
    out->room = bp_get_u64(p);
    out->prompt_tokens = bp_get_u32(p + 8);
    out->cached_tokens = bp_get_u32(p + 12);
    out->mamba_slot = bp_get_u32(p + 16);
    out->meta_row = bp_get_u32(p + 20);
    out->n_pages = bp_get_u32(p + 24);
    if (bp_get_u32(p + 28) != 0) return PD_ERR_PARSE;
    if (out->n_pages > BP_DEST_PAGES_MAX || (uint64_t)len != BP_DEST_FIXED + 4ull * out->n_pages)
        return PD_ERR_PARSE;
    out->pages = p + BP_DEST_FIXED;
    return PD_OK;
}

/* ---- room messages, PING, ERROR ---------------------------------------------------- */

size_t bp_room_write(uint8_t *out, size_t cap, bp_type type, uint64_t room, uint64_t value) {
    if (cap < BP_HEADER_BYTES + BP_ROOM_MSG_BYTES) return 0;
    bp_header_write(out, type, BP_ROOM_MSG_BYTES);
    bp_put_u64(out + 16, room);
    bp_put_u64(out + 24, value);
    return BP_HEADER_BYTES + BP_ROOM_MSG_BYTES;
}

pd_err bp_room_read(const uint8_t *p, uint32_t len, uint64_t *room, uint64_t *value) {
    if (len != BP_ROOM_MSG_BYTES) return PD_ERR_PARSE;
    *room = bp_get_u64(p);
    *value = bp_get_u64(p + 8);
    return PD_OK;
}

size_t bp_notice_write(uint8_t *out, uint64_t room, uint64_t bytes, uint64_t node_id) {
    bp_put_u64(out, room);
    bp_put_u64(out + 8, bytes);
    bp_put_u64(out + 16, node_id);
    return BP_NOTICE_BYTES;
}

pd_err bp_notice_read(const uint8_t *p, size_t len, uint64_t *room, uint64_t *bytes,
                      uint64_t *node_id) {
    if (len != BP_NOTICE_BYTES) return PD_ERR_PARSE;
    *room = bp_get_u64(p);
    *bytes = bp_get_u64(p + 8);
    *node_id = bp_get_u64(p + 16);
    return PD_OK;
}

size_t bp_notice_data_write(uint8_t *out, const bp_notice *nt) {
    if (nt->n_segs == 0 || nt->n_segs > BP_NOTICE_SEGS_MAX) return 0;
    bp_notice_write(out, nt->room, nt->bytes, nt->node_id);
    bp_put_u32(out + 24, nt->n_segs);
    bp_put_u32(out + 28, 0);
    for (uint32_t i = 0; i < nt->n_segs; i++) {
        uint8_t *q = out + BP_NOTICE_DATA_FIXED + BP_NOTICE_SEG_BYTES * i;
        bp_put_u32(q, nt->segs[i].region);
        bp_put_u32(q + 4, nt->segs[i].index);
        bp_put_u32(q + 8, nt->segs[i].units);
        bp_put_u32(q + 12, 0);
    }
    return BP_NOTICE_DATA_FIXED + (size_t)BP_NOTICE_SEG_BYTES * nt->n_segs;
}

pd_err bp_notice_data_read(const uint8_t *p, size_t len, bp_notice *out) {
    if (len < BP_NOTICE_DATA_FIXED || len > BP_NOTICE_DATA_HEADER_MAX) return PD_ERR_PARSE;
    memset(out, 0, sizeof(*out));
    PD_MUST(bp_notice_read(p, BP_NOTICE_BYTES, &out->room, &out->bytes, &out->node_id));
    out->n_segs = bp_get_u32(p + 24);
    if (bp_get_u32(p + 28) != 0 || out->n_segs == 0 || out->n_segs > BP_NOTICE_SEGS_MAX ||
        len != BP_NOTICE_DATA_FIXED + (size_t)BP_NOTICE_SEG_BYTES * out->n_segs)
        return PD_ERR_PARSE;
    for (uint32_t i = 0; i < out->n_segs; i++) {
        const uint8_t *q = p + BP_NOTICE_DATA_FIXED + BP_NOTICE_SEG_BYTES * i;
        bp_notice_seg *g = &out->segs[i];
        *g = (bp_notice_seg){bp_get_u32(q), bp_get_u32(q + 4), bp_get_u32(q + 8)};
        if (bp_get_u32(q + 12) != 0 || g->region >= BP_REG_COUNT || g->units == 0)
            return PD_ERR_PARSE;
        if (g->region != BP_REG_KV && (g->index != 0 || g->units != 1)) return PD_ERR_PARSE;
    }
    return PD_OK;
}

size_t bp_ping_write(uint8_t *out, size_t cap) {
    if (cap < BP_HEADER_BYTES) return 0;
    bp_header_write(out, BP_PING, 0);
    return BP_HEADER_BYTES;
}

size_t bp_error_write(uint8_t *out, size_t cap, bp_code code, bool has_room, uint64_t room,
                      const char *text) {
    size_t tl = text ? strlen(text) : 0;
    if (tl > BP_ERROR_TEXT_MAX) tl = BP_ERROR_TEXT_MAX;
    size_t len = 16 + tl;
    if (BP_HEADER_BYTES + len > cap) return 0;
    bp_header_write(out, BP_ERROR, (uint32_t)len);
    uint8_t *p = out + BP_HEADER_BYTES;
    bp_put_u32(p, (uint32_t)code);
    bp_put_u16(p + 4, (uint16_t)tl);
    bp_put_u16(p + 6, has_room ? BP_ERROR_FLAG_ROOM : 0);
    bp_put_u64(p + 8, has_room ? room : 0);
    if (tl) memcpy(p + 16, text, tl);
    return BP_HEADER_BYTES + len;
}

pd_err bp_error_read(const uint8_t *p, uint32_t len, bp_error *out) {
    if (len < 16) return PD_ERR_PARSE;
    out->code = bp_get_u32(p);
    out->text_len = bp_get_u16(p + 4);
    uint16_t flags = bp_get_u16(p + 6);
    out->has_room = flags & BP_ERROR_FLAG_ROOM;
    out->room = bp_get_u64(p + 8);
    if ((flags & ~BP_ERROR_FLAG_ROOM) || (!out->has_room && out->room) ||
        out->text_len > BP_ERROR_TEXT_MAX || (uint32_t)16 + out->text_len != len)
        return PD_ERR_PARSE;
    out->text = p + 16;
    return PD_OK;
}
