/* The bootstrap channel's frame decoder, on both sides: a 16-byte header
 * check, then the payload reader for the type it names, exactly as a node
 * parses bytes from a socket (src/xfer/net_conn.c, peer_parse). */
#include <string.h>

#include "../../src/xfer/bootstrap_proto.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < BP_HEADER_BYTES) return 0;
    bp_header h;
    bp_code code;
    if (bp_header_check(data, &h, &code) != PD_OK) return 0;
    const uint8_t *pl = data + BP_HEADER_BYTES;
    size_t have = size - BP_HEADER_BYTES;
    uint32_t len = h.length <= have ? h.length : (uint32_t)have;
    bp_hello hello;
    bp_dest dest;
    bp_error err;
    uint64_t a, b;
    uint32_t c;
    uint8_t nonce[BP_NONCE_BYTES], proof[BP_PROOF_BYTES];
    (void)bp_type_for_role(h.type, size & 1);
    switch (h.type) {
    case BP_HELLO:
        if (bp_hello_read(pl, len, &hello) == PD_OK) {
            /* every pointer the reader hands out lies inside the payload */
            PD_ASSERT(hello.proof >= pl && hello.proof + BP_PROOF_BYTES <= pl + len);
            PD_ASSERT(hello.worker_addr >= pl &&
                      hello.worker_addr + hello.worker_addr_len <= pl + len);
        }
        break;
    case BP_HELLO_OK: bp_hello_ok_read(pl, len, &a, &c); break;
    case BP_DEST:
        if (bp_dest_read(pl, len, &dest) == PD_OK)
            for (uint32_t i = 0; i < dest.n_pages; i++) (void)bp_dest_page(&dest, i);
        break;
    case BP_ERROR: bp_error_read(pl, len, &err); break;
    case BP_AUTH: bp_auth_read(pl, len, nonce); break;
    case BP_CHALLENGE: bp_challenge_read(pl, len, nonce, proof); break;
    default: bp_room_read(pl, len, &a, &b); break;
    }
    /* A data notice's header (version 4, a UCX active message, not a frame):
     * the same bytes, read as one. */
    bp_notice nt;
    if (bp_notice_data_read(pl, len, &nt) == PD_OK)
        PD_ASSERT(nt.n_segs >= 1 && nt.n_segs <= BP_NOTICE_SEGS_MAX &&
                  len == BP_NOTICE_DATA_FIXED + BP_NOTICE_SEG_BYTES * nt.n_segs);
    return 0;
}
