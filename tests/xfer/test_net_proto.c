/* The bootstrap wire format on its own: every message round-trips, every
 * field is little-endian at its documented offset, and each kind of damage
 * (bad magic, unknown version, non-zero flags, oversize length, a length that
 * disagrees with the fields, trailing bytes) is refused with the right code.
 * A randomised pass feeds mutated messages to every decoder: refused or
 * accepted, never read out of bounds (ASan watches). And UCX's configuration
 * as pd_net builds it. */
#include "../test_util.h"
#include "bootstrap_proto.h"
#include "net_internal.h"
#include "pdserve/xfer.h"

#include <stdlib.h>

static uint8_t buf[BP_HEADER_BYTES + BP_HELLO_MAX];

static void header_fields_are_little_endian_at_fixed_offsets(void **state) {
    (void)state;
    size_t len =
        bp_room_write(buf, sizeof(buf), BP_DONE, 0x0102030405060708ull, 0x1122334455667788ull);
    assert_int_equal(len, 32);
    const uint8_t want[16] = {'P', 'D', 'B', 'S', BP_VERSION, 0, BP_DONE, 0,
                              0,   0,   0,   0,   16,         0, 0,       0};
    assert_memory_equal(buf, want, 16);
    assert_int_equal(buf[16], 0x08);
    assert_int_equal(buf[23], 0x01);
    assert_int_equal(buf[24], 0x88);
    bp_header h;
    bp_code code;
    assert_ok(bp_header_check(buf, &h, &code));
    assert_int_equal(h.type, BP_DONE);
    assert_int_equal(h.length, 16);
    uint64_t room_id, value;
    assert_ok(bp_room_read(buf + 16, h.length, &room_id, &value));
    assert_true(room_id == 0x0102030405060708ull && value == 0x1122334455667788ull);
}

static void damaged_headers_are_refused_with_their_code(void **state) {
    (void)state;
    bp_header h;
    bp_code code;
    bp_ping_write(buf, sizeof(buf));
    assert_ok(bp_header_check(buf, &h, &code));
    buf[0] ^= 1;
    assert_err(bp_header_check(buf, &h, &code), PD_ERR_PARSE);
    assert_int_equal(code, BP_E_MALFORMED);
    bp_ping_write(buf, sizeof(buf));
    bp_put_u16(buf + 4, 1); /* version 1 sent the token in clear: refused */
    assert_err(bp_header_check(buf, &h, &code), PD_ERR_PARSE);
    assert_int_equal(code, BP_E_VERSION);
    assert_int_equal(h.version, 1);
    bp_ping_write(buf, sizeof(buf));
    bp_put_u16(buf + 4, 2); /* version 2 ended a room with DONE on TCP: refused */
    assert_err(bp_header_check(buf, &h, &code), PD_ERR_PARSE);
    assert_int_equal(code, BP_E_VERSION);
    bp_ping_write(buf, sizeof(buf));
    bp_put_u32(buf + 8, 4);
    assert_err(bp_header_check(buf, &h, &code), PD_ERR_PARSE);
    assert_int_equal(code, BP_E_MALFORMED);
    bp_ping_write(buf, sizeof(buf));
    bp_put_u16(buf + 6, 77);
    assert_err(bp_header_check(buf, &h, &code), PD_ERR_PARSE);
    assert_int_equal(code, BP_E_UNEXPECTED);
    /* Oversize: over the global limit, and over a small type's limit. */
    bp_header_write(buf, BP_DEST, BP_PAYLOAD_MAX + 1);
    assert_err(bp_header_check(buf, &h, &code), PD_ERR_TOOBIG);
    assert_int_equal(code, BP_E_TOO_BIG);
    bp_header_write(buf, BP_ACK, 17);
    assert_err(bp_header_check(buf, &h, &code), PD_ERR_TOOBIG);
    bp_header_write(buf, BP_PING, 1);
    assert_err(bp_header_check(buf, &h, &code), PD_ERR_TOOBIG);
}

static bp_hello sample_hello(uint8_t *keys) {
    static const uint8_t addr[40] = {9, 8, 7};
    for (int i = 0; i < 30; i++) keys[i] = (uint8_t)(i * 3);
    bp_hello h = {
        .node_id = 0xFEEDu,
        .page_size = 16,
        .meta_row_bytes = sizeof(pd_meta_row),
        .worker_addr_len = sizeof(addr),
        .worker_addr = addr,
    };
    h.region[0] = (bp_region){.base = 0x10000, .unit_bytes = 4096, .units = 100,
                              .rkey_len = 10, .rkey = keys};
    h.region[1] = (bp_region){.base = 0x90000, .unit_bytes = 999, .units = 3,
                              .rkey_len = 12, .rkey = keys + 10};
    h.region[2] = (bp_region){.base = 0xA0000, .unit_bytes = 32, .units = 8,
                              .rkey_len = 8, .rkey = keys + 22};
    return h;
}

static bp_auth sample_auth(const char *token) {
    bp_auth a = {.key = (const uint8_t *)token, .key_len = token ? strlen(token) : 0};
    for (unsigned i = 0; i < BP_NONCE_BYTES; i++) {
        a.nonce_decode[i] = (uint8_t)(i + 1);
        a.nonce_prefill[i] = (uint8_t)(200 - i);
    }
    return a;
}

static void hello_round_trips_and_checks_lengths(void **state) {
    (void)state;
    uint8_t keys[30];
    bp_hello h = sample_hello(keys), g;
    bp_auth a = sample_auth("secret");
    size_t len = bp_hello_write(buf, sizeof(buf), &h, &a);
    assert_int_equal(len, 16 + 96 + 32 + 40 + 30);
    assert_ok(bp_hello_read(buf + 16, (uint32_t)(len - 16), &g));
    assert_int_equal(g.node_id, h.node_id);
    assert_int_equal(g.page_size, 16);
    assert_true(g.proof == buf + 16 + 96);
    assert_true(bp_hello_verify(&a, buf + 16, (uint32_t)(len - 16)));
    assert_memory_equal(g.worker_addr, h.worker_addr, 40);
    for (int r = 0; r < 3; r++) {
        assert_int_equal(g.region[r].base, h.region[r].base);
        assert_int_equal(g.region[r].unit_bytes, h.region[r].unit_bytes);
        assert_int_equal(g.region[r].units, h.region[r].units);
        assert_int_equal(g.region[r].rkey_len, h.region[r].rkey_len);
        assert_memory_equal(g.region[r].rkey, h.region[r].rkey, h.region[r].rkey_len);
    }
    /* One byte short or one byte extra: refused. */
    assert_err(bp_hello_read(buf + 16, (uint32_t)(len - 17), &g), PD_ERR_PARSE);
    assert_err(bp_hello_read(buf + 16, (uint32_t)(len - 15), &g), PD_ERR_PARSE);
    /* A region whose byte range wraps the address space. */
    bp_hello w = h;
    w.region[0].base = UINT64_MAX - 100;
    len = bp_hello_write(buf, sizeof(buf), &w, &a);
    assert_err(bp_hello_read(buf + 16, (uint32_t)(len - 16), &g), PD_ERR_PARSE);
    /* A region with units but no key. */
    w = h;
    w.region[1].rkey_len = 0;
    len = bp_hello_write(buf, sizeof(buf), &w, &a);
    assert_err(bp_hello_read(buf + 16, (uint32_t)(len - 16), &g), PD_ERR_PARSE);
    /* Too long a worker address cannot even be encoded. */
    w = h;
    w.worker_addr_len = BP_WORKER_ADDR_MAX + 1;
    assert_int_equal(bp_hello_write(buf, sizeof(buf), &w, &a), 0);
}

/* The proofs: each side's depends on the token, on both nonces and (the
 * decode's) on every byte of the HELLO; neither is valid as the other's. */
static void proofs_bind_token_nonces_and_hello(void **state) {
    (void)state;
    uint8_t keys[30], p1[BP_PROOF_BYTES], p2[BP_PROOF_BYTES];
    bp_hello h = sample_hello(keys);
    bp_auth a = sample_auth("secret"), b;
    size_t len = bp_hello_write(buf, sizeof(buf), &h, &a);
    uint32_t plen = (uint32_t)(len - 16);
    const char *others[] = {NULL, "secreT", "secret-and-more", "secre"};
    for (size_t i = 0; i < PD_ARRAY_LEN(others); i++) {
        b = sample_auth(others[i]);
        assert_false(bp_hello_verify(&b, buf + 16, plen));
        bp_prefill_proof(&a, p1);
        bp_prefill_proof(&b, p2);
        assert_false(bp_proof_equal(p1, p2));
    }
    b = a;
    b.nonce_prefill[7] ^= 1; /* a replayed HELLO under a fresh challenge */
    assert_false(bp_hello_verify(&b, buf + 16, plen));
    b = a;
    b.nonce_decode[31] ^= 0x80;
    assert_false(bp_hello_verify(&b, buf + 16, plen));
    bp_prefill_proof(&b, p2);
    bp_prefill_proof(&a, p1);
    assert_false(bp_proof_equal(p1, p2));
    /* Any byte of the HELLO changed after signing (a swapped worker address
     * or key): the proof no longer verifies. */
    for (uint32_t i = 0; i < plen; i += 7) {
        buf[16 + i] ^= 0x10;
        assert_false(bp_hello_verify(&a, buf + 16, plen));
        buf[16 + i] ^= 0x10;
    }
    assert_true(bp_hello_verify(&a, buf + 16, plen));
    /* No token on both sides: proofs still verify (an empty key). */
    b = sample_auth(NULL);
    len = bp_hello_write(buf, sizeof(buf), &h, &b);
    assert_true(bp_hello_verify(&b, buf + 16, (uint32_t)(len - 16)));
    /* AUTH and CHALLENGE round-trip and are exact in length. */
    uint8_t nonce[BP_NONCE_BYTES], proof[BP_PROOF_BYTES];
    len = bp_auth_write(buf, sizeof(buf), a.nonce_decode);
    assert_int_equal(len, 16 + 32);
    assert_ok(bp_auth_read(buf + 16, 32, nonce));
    assert_memory_equal(nonce, a.nonce_decode, 32);
    assert_err(bp_auth_read(buf + 16, 31, nonce), PD_ERR_PARSE);
    bp_prefill_proof(&a, p1);
    len = bp_challenge_write(buf, sizeof(buf), a.nonce_prefill, p1);
    assert_int_equal(len, 16 + 64);
    assert_ok(bp_challenge_read(buf + 16, 64, nonce, proof));
    assert_memory_equal(nonce, a.nonce_prefill, 32);
    assert_memory_equal(proof, p1, 32);
    assert_err(bp_challenge_read(buf + 16, 65, nonce, proof), PD_ERR_PARSE);
}

/* Each role refuses on the header the types it never receives (a 1 MiB
 * DEST sent to a decode node is never buffered). */
static void types_are_checked_against_the_role(void **state) {
    (void)state;
    const uint32_t to_prefill[] = {BP_AUTH, BP_HELLO, BP_DEST};
    const uint32_t to_decode[] = {BP_CHALLENGE, BP_HELLO_OK, BP_DEST_OK, BP_START, BP_DONE, BP_ACK};
    for (size_t i = 0; i < PD_ARRAY_LEN(to_prefill); i++) {
        assert_true(bp_type_for_role(to_prefill[i], true));
        assert_false(bp_type_for_role(to_prefill[i], false));
    }
    for (size_t i = 0; i < PD_ARRAY_LEN(to_decode); i++) {
        assert_false(bp_type_for_role(to_decode[i], true));
        assert_true(bp_type_for_role(to_decode[i], false));
    }
    const uint32_t both[] = {BP_ABORT, BP_PING, BP_ERROR};
    for (size_t i = 0; i < PD_ARRAY_LEN(both); i++)
        assert_true(bp_type_for_role(both[i], true) && bp_type_for_role(both[i], false));
    assert_false(bp_type_for_role(0, true) || bp_type_for_role(BP__TYPE_COUNT, false));
}

static void dest_round_trips_and_refuses_inconsistent_counts(void **state) {
    (void)state;
    uint32_t pages[5] = {4, 0xFFFFFFFEu, 7, 8, 1};
    size_t len = bp_dest_write(buf, sizeof(buf), 55, 70, 0, BP_NONE, 3, pages, 5);
    assert_int_equal(len, 16 + 32 + 20);
    bp_dest d;
    assert_ok(bp_dest_read(buf + 16, (uint32_t)(len - 16), &d));
    assert_int_equal(d.room, 55);
    assert_int_equal(d.prompt_tokens, 70);
    assert_int_equal(d.mamba_slot, BP_NONE);
    assert_int_equal(d.meta_row, 3);
    assert_int_equal(d.n_pages, 5);
    for (uint32_t i = 0; i < 5; i++) assert_int_equal(bp_dest_page(&d, i), pages[i]);
    /* n_pages says 5, the payload holds 4 or 6 pages. */
    assert_err(bp_dest_read(buf + 16, (uint32_t)(len - 16 - 4), &d), PD_ERR_PARSE);
    assert_err(bp_dest_read(buf + 16, (uint32_t)(len - 16 + 4), &d), PD_ERR_PARSE);
    /* A page count whose byte size would overflow. */
    bp_put_u32(buf + 16 + 24, 0xFFFFFFFFu);
    assert_err(bp_dest_read(buf + 16, (uint32_t)(len - 16), &d), PD_ERR_PARSE);
    /* Reserved bits set. */
    len = bp_dest_write(buf, sizeof(buf), 55, 70, 0, 1, 3, pages, 5);
    bp_put_u32(buf + 16 + 28, 1);
    assert_err(bp_dest_read(buf + 16, (uint32_t)(len - 16), &d), PD_ERR_PARSE);
}

static void notice_round_trips_and_checks_its_length(void **state) {
    (void)state;
    uint8_t wire[BP_NOTICE_BYTES];
    assert_int_equal(bp_notice_write(wire, 0x0102030405060708ull, 1u << 20, 77), 24);
    assert_int_equal(wire[0], 0x08); /* little-endian, room first */
    uint64_t room_id = 0, bytes = 0, node = 0;
    assert_ok(bp_notice_read(wire, sizeof(wire), &room_id, &bytes, &node));
    assert_true(room_id == 0x0102030405060708ull && bytes == (1u << 20) && node == 77);
    assert_err(bp_notice_read(wire, sizeof(wire) - 1, &room_id, &bytes, &node), PD_ERR_PARSE);
    assert_err(bp_notice_read(wire, 0, &room_id, &bytes, &node), PD_ERR_PARSE);
}

/* Version 4's notice that carries its room's bytes: the header round-trips,
 * and every field a peer could get wrong is refused on parse. */
static void notice_with_data_round_trips_and_checks_every_field(void **state) {
    (void)state;
    uint8_t wire[BP_NOTICE_DATA_HEADER_MAX + 16];
    bp_notice nt = {.room = 77, .bytes = 3 * 512 + 3000 + 192, .node_id = 5, .n_segs = 4};
    nt.segs[0] = (bp_notice_seg){BP_REG_KV, 0, 2};
    nt.segs[1] = (bp_notice_seg){BP_REG_KV, 2, 1};
    nt.segs[2] = (bp_notice_seg){BP_REG_MAMBA, 0, 1};
    nt.segs[3] = (bp_notice_seg){BP_REG_META, 0, 1};
    size_t len = bp_notice_data_write(wire, &nt);
    assert_int_equal(len, BP_NOTICE_DATA_FIXED + 4 * BP_NOTICE_SEG_BYTES);
    bp_notice back;
    assert_ok(bp_notice_data_read(wire, len, &back));
    assert_memory_equal(&back, &nt, sizeof(nt));
    /* The plain notice's 24 bytes are not a data notice's header. */
    assert_err(bp_notice_data_read(wire, BP_NOTICE_BYTES, &back), PD_ERR_PARSE);
    /* Length not what the count says, either way. */
    assert_err(bp_notice_data_read(wire, len - 1, &back), PD_ERR_PARSE);
    assert_err(bp_notice_data_read(wire, len + 16, &back), PD_ERR_PARSE);
    /* No segment, too many, reserved bits, unknown region, zero units, a
     * Mamba or metadata segment that is not the room's one unit. */
    struct {
        size_t off;
        uint32_t v;
    } bad[] = {
        {24, 0},     {24, BP_NOTICE_SEGS_MAX + 1},
        {28, 1},     {32 + 12, 1},
        {32, 3},     {32 + 8, 0},
        {64 + 4, 1}, {64 + 8, 2},
    };
    for (size_t i = 0; i < PD_ARRAY_LEN(bad); i++) {
        bp_notice_data_write(wire, &nt);
        bp_put_u32(wire + bad[i].off, bad[i].v);
        if (bp_notice_data_read(wire, len, &back) != PD_ERR_PARSE)
            fail_msg("case %zu (u32 at %zu = %u) was accepted", i, bad[i].off, bad[i].v);
    }
    nt.n_segs = 0;
    assert_int_equal(bp_notice_data_write(wire, &nt), 0);
    nt.n_segs = BP_NOTICE_SEGS_MAX + 1;
    assert_int_equal(bp_notice_data_write(wire, &nt), 0);
}

/* Version 5 nodes speak 4 and 3 to older peers: all three pass the header
 * check; older and newer ones do not. */
static void versions_3_to_5_pass_the_header_check(void **state) {
    (void)state;
    bp_header h;
    bp_code code;
    for (uint16_t v = 0; v < 8; v++) {
        bp_ping_write(buf, sizeof(buf));
        bp_put_u16(buf + 4, v);
        pd_err err = bp_header_check(buf, &h, &code);
        if (v >= 3 && v <= 5) {
            assert_ok(err);
            assert_int_equal(h.version, v);
        } else {
            assert_err(err, PD_ERR_PARSE);
            assert_int_equal(code, BP_E_VERSION);
        }
    }
}

static void error_and_small_messages_round_trip(void **state) {
    (void)state;
    size_t len = bp_error_write(buf, sizeof(buf), BP_E_AUTH, false, 0, "wrong token");
    bp_error e;
    assert_ok(bp_error_read(buf + 16, (uint32_t)(len - 16), &e));
    assert_int_equal(e.code, BP_E_AUTH);
    assert_false(e.has_room);
    assert_int_equal(e.text_len, 11);
    assert_memory_equal(e.text, "wrong token", 11);
    len = bp_error_write(buf, sizeof(buf), BP_E_ROOM_DUPLICATE, true, 0, "dup");
    assert_ok(bp_error_read(buf + 16, (uint32_t)(len - 16), &e));
    assert_true(e.has_room);
    assert_int_equal(e.room, 0); /* room 0 is an ordinary room */
    /* Text is cut at the limit, never overflows. */
    char longtext[600];
    memset(longtext, 'x', sizeof(longtext) - 1);
    longtext[sizeof(longtext) - 1] = 0;
    len = bp_error_write(buf, sizeof(buf), BP_E_MALFORMED, false, 0, longtext);
    assert_int_equal(len, 16 + 16 + BP_ERROR_TEXT_MAX);
    uint64_t id;
    uint32_t ps;
    len = bp_hello_ok_write(buf, sizeof(buf), 77, 16);
    assert_ok(bp_hello_ok_read(buf + 16, 16, &id, &ps));
    assert_true(id == 77 && ps == 16);
    assert_err(bp_hello_ok_read(buf + 16, 15, &id, &ps), PD_ERR_PARSE);
    assert_string_equal(bp_type_name(BP_ACK), "ACK");
    assert_string_equal(bp_type_name(999), "UNKNOWN");
    assert_string_equal(bp_code_name(BP_E_VERSION), "version");
}

static void mutated_messages_never_read_out_of_bounds(void **state) {
    (void)state;
    pd_rng rng;
    pd_rng_seed(&rng, test_seed(7));
    uint8_t keys[30];
    bp_hello h = sample_hello(keys);
    bp_auth auth = sample_auth("secret");
    uint32_t pages[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    static uint8_t msg[5][BP_HEADER_BYTES + 400];
    bp_notice nt = {.room = 4, .bytes = 9000, .node_id = 2, .n_segs = 3};
    nt.segs[0] = (bp_notice_seg){BP_REG_KV, 1, 2};
    nt.segs[1] = (bp_notice_seg){BP_REG_MAMBA, 0, 1};
    nt.segs[2] = (bp_notice_seg){BP_REG_META, 0, 1};
    size_t lens[5] = {
        bp_hello_write(msg[0], sizeof(msg[0]), &h, &auth),
        bp_dest_write(msg[1], sizeof(msg[1]), 1, 33, 0, 0, 0, pages, 9),
        bp_error_write(msg[2], sizeof(msg[2]), BP_E_BUSY, true, 9, "busy"),
        bp_room_write(msg[3], sizeof(msg[3]), BP_ABORT, 3, 1),
        16 + bp_notice_data_write(msg[4] + 16, &nt), /* an AM header, framed like the rest */
    };
    for (int iter = 0; iter < 20000; iter++) {
        int k = (int)pd_rng_below(&rng, 5);
        /* The payload goes into an exactly sized heap copy so ASan sees any
         * read past its end. */
        uint32_t plen = (uint32_t)(lens[k] - 16);
        if (pd_rng_chance(&rng, 1, 3)) plen = (uint32_t)pd_rng_below(&rng, plen + 8);
        uint8_t *p = malloc(plen ? plen : 1);
        memcpy(p, msg[k] + 16, PD_MIN(plen, lens[k] - 16));
        for (uint32_t i = PD_MIN(plen, (uint32_t)(lens[k] - 16)); i < plen; i++)
            p[i] = (uint8_t)pd_rng_next(&rng);
        for (int flips = (int)pd_rng_below(&rng, 4); flips > 0 && plen > 0; flips--)
            p[pd_rng_below(&rng, plen)] ^= (uint8_t)(1u << pd_rng_below(&rng, 8));
        bp_hello gh;
        bp_dest gd;
        bp_error ge;
        uint64_t a, b;
        if (bp_hello_read(p, plen, &gh) == PD_OK) {
            size_t total = (size_t)gh.worker_addr_len;
            for (int r = 0; r < 3; r++) total += gh.region[r].rkey_len;
            assert_true(96 + 32 + total == plen);
        }
        if (bp_dest_read(p, plen, &gd) == PD_OK) {
            uint32_t sum = 0;
            for (uint32_t i = 0; i < gd.n_pages; i++) sum += bp_dest_page(&gd, i);
            (void)sum;
        }
        if (bp_error_read(p, plen, &ge) == PD_OK) assert_true(16u + ge.text_len == plen);
        if (bp_room_read(p, plen, &a, &b) == PD_OK) assert_int_equal(plen, 16);
        bp_notice gn;
        if (bp_notice_data_read(p, plen, &gn) == PD_OK)
            assert_int_equal(plen, BP_NOTICE_DATA_FIXED + BP_NOTICE_SEG_BYTES * gn.n_segs);
        free(p);
    }
}

/* The value UCX's configuration as pd_net makes it (cfg) holds for `name`
 * (without UCX_), while the environment sets UCX_<name>=env_value. */
static void config_value_over_env(const pd_net_config *cfg, const char *name, const char *env_value,
                                  char *v, size_t cap) {
    char env[64], key[72], msg[256];
    snprintf(env, sizeof(env), "UCX_%s", name);
    snprintf(key, sizeof(key), "UCX_%s=", name);
    ucp_config_t *uc = NULL;
    assert_int_equal(setenv(env, env_value, 1), 0);
    pd_err err = net_ucx_config_make(cfg, &uc, msg, sizeof(msg));
    assert_int_equal(unsetenv(env), 0);
    assert_ok(err);
    net_ucx_config_value(uc, key, v, cap);
    ucp_config_release(uc);
}

/* Adaptive progress leaves the decode's receive-only shared-memory interface
 * armed, and every completion notice then costs a signal and a wake-up of
 * UCX's async thread (net_ucx.c): pd_net turns it off, over the
 * environment's setting too. */
static void adaptive_progress_is_off(void **state) {
    (void)state;
    pd_net_config cfg = {0};
    char msg[256], v[32];
    config_value_over_env(&cfg, "ADAPTIVE_PROGRESS", "y", v, sizeof(v));
    assert_string_equal(v, "n");
    ucp_config_t *uc = NULL;
    assert_ok(net_ucx_config_make(&cfg, &uc, msg, sizeof(msg)));
    net_ucx_config_value(uc, "UCX_TLS=", v, sizeof(v));
    ucp_config_release(uc);
    assert_true(v[0] != '\0'); /* the lookup itself finds a setting UCX prints */
}

/* UCX's keepalive is off, over the environment's setting too: its first
 * round sends an EP_CHECK at once, and a prefill that reads it after
 * closing its endpoint to a decode that is going away connects back to the
 * gone decode, which aborts the process inside UCX 1.13's tcp transport
 * (net_ucx.c). Our heartbeats tell a dead peer instead. */
static void ucx_keepalive_is_off(void **state) {
    (void)state;
    static const char *const tls[] = {NULL, "tcp", "shm", "shm,tcp"};
    for (size_t i = 0; i < PD_ARRAY_LEN(tls); i++) {
        pd_net_config cfg = {.ucx_tls = tls[i]};
        char v[32];
        config_value_over_env(&cfg, "KEEPALIVE_INTERVAL", "1s", v, sizeof(v));
        assert_string_equal(v, "inf");
    }
}

/* tcp's send segment is asked for only where tcp may be used: with shared
 * memory alone UCX would warn "invalid configuration: TX_SEG_SIZE=64K" at
 * every worker's creation (it did, in each shm deployment's log). */
static void tcp_segment_only_where_tcp_may_be_used(void **state) {
    (void)state;
    static const struct {
        const char *tls, *want;
    } cases[] = {{"shm", ""},
                 {"posix,sysv,cma", ""},
                 {"tcp", TCP_TX_SEG},
                 {"shm,tcp", TCP_TX_SEG},
                 {"^tcp", TCP_TX_SEG}};
    for (size_t i = 0; i < PD_ARRAY_LEN(cases); i++) {
        pd_net_config cfg = {.ucx_tls = cases[i].tls};
        char msg[256], v[32];
        ucp_config_t *uc = NULL;
        assert_ok(net_ucx_config_make(&cfg, &uc, msg, sizeof(msg)));
        net_ucx_config_value(uc, "TX_SEG_SIZE=", v, sizeof(v));
        ucp_config_release(uc);
        assert_string_equal(v, cases[i].want);
    }
}

/* Every node that may use tcp receives segments as large as a peer with
 * ucx_tcp_large_segments sends (UCX refuses a send segment larger than its
 * own receive segment, and an older receiver does not check the length);
 * only such a node sends them. */
static void tcp_large_segments_are_received_everywhere_sent_on_request(void **state) {
    (void)state;
    static const struct {
        const char *tls;
        bool large;
        const char *rx, *tx;
    } cases[] = {{"shm", true, "", ""},
                 {"tcp", false, TCP_RX_SEG, TCP_TX_SEG},
                 {"tcp", true, TCP_RX_SEG, TCP_TX_SEG_LARGE},
                 {"shm,tcp", true, TCP_RX_SEG, TCP_TX_SEG_LARGE},
                 {"^shm", false, TCP_RX_SEG, TCP_TX_SEG}};
    for (size_t i = 0; i < PD_ARRAY_LEN(cases); i++) {
        pd_net_config cfg = {.ucx_tls = cases[i].tls, .ucx_tcp_large_segments = cases[i].large};
        char msg[256], rx[32], tx[32];
        ucp_config_t *uc = NULL;
        assert_ok(net_ucx_config_make(&cfg, &uc, msg, sizeof(msg)));
        net_ucx_config_value(uc, "RX_SEG_SIZE=", rx, sizeof(rx));
        net_ucx_config_value(uc, "TX_SEG_SIZE=", tx, sizeof(tx));
        ucp_config_release(uc);
        assert_string_equal(rx, cases[i].rx);
        assert_string_equal(tx, cases[i].tx);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(header_fields_are_little_endian_at_fixed_offsets),
        cmocka_unit_test(damaged_headers_are_refused_with_their_code),
        cmocka_unit_test(hello_round_trips_and_checks_lengths),
        cmocka_unit_test(proofs_bind_token_nonces_and_hello),
        cmocka_unit_test(types_are_checked_against_the_role),
        cmocka_unit_test(dest_round_trips_and_refuses_inconsistent_counts),
        cmocka_unit_test(notice_round_trips_and_checks_its_length),
        cmocka_unit_test(notice_with_data_round_trips_and_checks_every_field),
        cmocka_unit_test(versions_3_to_5_pass_the_header_check),
        cmocka_unit_test(error_and_small_messages_round_trip),
        cmocka_unit_test(mutated_messages_never_read_out_of_bounds),
        cmocka_unit_test(adaptive_progress_is_off),
        cmocka_unit_test(ucx_keepalive_is_off),
        cmocka_unit_test(tcp_segment_only_where_tcp_may_be_used),
        cmocka_unit_test(tcp_large_segments_are_received_everywhere_sent_on_request),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
