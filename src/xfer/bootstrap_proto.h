/*
 * bootstrap_proto — the wire format of pd_net's bootstrap (control) channel:
 * framing, encoders and decoders. Pure functions over byte buffers: no
 * sockets, no UCX, no allocation, so every rule a hostile peer could probe is
 * testable in isolation. docs/bootstrap-protocol.md is the prose version.
 *
 * Framing. Every message is a 16-byte header followed by `length` payload
 * bytes. All integers are little-endian, fixed width, whatever the host:
 *
 *   off 0  u32 magic    BP_MAGIC ("PDBS" as bytes)
 *   off 4  u16 version  BP_VERSION
 *   off 6  u16 type     bp_type
 *   off 8  u32 flags    0 (anything else is refused)
 *   off 12 u32 length   payload bytes, at most the type's limit
 *
 * The header is checked before a single payload byte is read, so a peer
 * that announces an oversize message is refused without being buffered.
 * Decoders check that the payload length is exactly what the fields say
 * (no trailing bytes, no short reads) and return pointers into the caller's
 * buffer for variable-length parts: nothing is copied, nothing allocated.
 *
 * Trade-off: fixed layouts with explicit offsets cost a few lines per message
 * compared with a generic TLV scheme, but they make "what does byte 12 mean"
 * answerable from one table, and a version bump the only way to change them.
 */
#ifndef PDSERVE_XFER_BOOTSTRAP_PROTO_H
#define PDSERVE_XFER_BOOTSTRAP_PROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pdserve/base.h"

#define BP_MAGIC 0x53424450u /* bytes 'P' 'D' 'B' 'S' */
/* The newest protocol version this build speaks, and the oldest it still
 * speaks to a peer that asks for it (docs/bootstrap-protocol.md,
 * "Versioning"): a connection speaks the version of the decode node's AUTH. */
#define BP_VERSION 5u
#define BP_VERSION_MIN 3u
#define BP_HEADER_BYTES 16u
/* Hard limit on any payload: a destination of 262,144 pages (4M tokens at
 * page size 16) fits. */
#define BP_PAYLOAD_MAX (1u << 20)
#define BP_HELLO_MAX (64u << 10)
#define BP_TOKEN_MAX 256u
#define BP_NONCE_BYTES 32u
#define BP_PROOF_BYTES 32u /* HMAC-SHA-256 */
#define BP_WORKER_ADDR_MAX 8192u
#define BP_RKEY_MAX 4096u
#define BP_ERROR_TEXT_MAX 240u
#define BP_DEST_FIXED 32u
#define BP_DEST_PAGES_MAX ((BP_PAYLOAD_MAX - BP_DEST_FIXED) / 4u)
#define BP_ROOM_MSG_BYTES 16u
/* Version 3: a room's completion notice travels on the data path, as a UCX
 * active message of this id on the endpoint that carried the room's puts,
 * after them (docs/bootstrap-protocol.md, "A room"). Its header is
 * u64 room, u64 bytes written, u64 the prefill's node_id; no data. */
#define BP_AM_NOTICE 3u
#define BP_NOTICE_BYTES 24u
/* Version 4: a small room's completion notice carries the room's bytes
 * itself, as an active message of this id: its header is the notice's 24
 * bytes, u32 segment count, u32 reserved = 0, then per segment u32 region
 * (BP_REG_*), u32 index, u32 units, u32 reserved = 0; its data is the
 * segments' bytes in that order. A KV segment's index is a position in the
 * room's destination page list (the DEST's order), and it covers positions
 * [index, index + units); a Mamba or metadata segment is the room's one slot
 * or row (index 0, one unit). Positions, never addresses: the decode node
 * maps them through its own destination, so no value on the wire can name
 * memory outside the room. */
#define BP_AM_NOTICE_DATA 4u
#define BP_NOTICE_DATA_FIXED 32u
#define BP_NOTICE_SEG_BYTES 16u
#define BP_NOTICE_SEGS_MAX 8u
#define BP_NOTICE_DATA_MAX (1u << 20) /* bytes one notice may carry */
#define BP_NOTICE_DATA_HEADER_MAX (BP_NOTICE_DATA_FIXED + BP_NOTICE_SEGS_MAX * BP_NOTICE_SEG_BYTES)
/* Version 5: where UCX emulates puts (tcp), a room's bytes travel as data
 * messages, active messages of this id on the endpoint of its notice, each
 * laid out exactly as a data-bearing notice (same header, same checks) with
 * at most BP_NOTICE_DATA_MAX bytes, but not the room's end: the plain notice
 * (BP_AM_NOTICE) follows them on the same endpoint. No put, so nothing the
 * decode's UCX must acknowledge, and the decode copies the bytes in itself
 * only while the room owns its pages (docs/bootstrap-protocol.md, "A room"). */
#define BP_AM_DATA 5u
#define BP_NONE UINT32_MAX

typedef enum bp_type {
    BP_HELLO = 1, /* decode -> prefill: memory descriptors, its proof of the token */
    BP_HELLO_OK,  /* prefill -> decode: accepted */
    BP_DEST,      /* decode -> prefill: a room's destination */
    BP_DEST_OK,   /* prefill -> decode: destination accepted (WAITING_FOR_INPUT) */
    BP_START,     /* prefill -> decode: the first write of the room was posted */
    BP_DONE,      /* prefill -> decode: every write of the room landed */
    BP_ABORT,     /* both ways: decode asks to stop / prefill stopped for good */
    BP_ACK,       /* prefill -> decode: stopped after the decode's ABORT */
    BP_PING,      /* both ways: heartbeat, empty payload */
    BP_ERROR,     /* both ways: a refusal, of one room or of the connection */
    BP_AUTH,      /* decode -> prefill, first: the decode's nonce */
    BP_CHALLENGE, /* prefill -> decode: the prefill's nonce and its proof */
    BP__TYPE_COUNT
} bp_type;

/* Error codes carried by BP_ERROR. An ERROR with the room flag refuses
 * that room only; without it, it ends the connection. */
typedef enum bp_code {
    BP_E_MALFORMED = 1,  /* bad magic, bad field, wrong length */
    BP_E_VERSION,        /* unsupported protocol version */
    BP_E_AUTH,           /* a proof of the token that does not verify */
    BP_E_TOO_BIG,        /* length over the limit */
    BP_E_UNEXPECTED,     /* message type not valid in this state or direction */
    BP_E_ROOM_UNKNOWN,   /* the room is not this connection's */
    BP_E_ROOM_DUPLICATE, /* a destination for this room already exists */
    BP_E_DEST_INVALID,   /* page ids, slot or row out of range; sizes inconsistent */
    BP_E_MISMATCH,       /* page size or memory layout differs between nodes */
    BP_E_BUSY,           /* no room or connection slot free */
    BP_E_UCX,            /* no UCX path to the peer's worker */
    BP_E_TIMEOUT,        /* hello or message not completed in time */
} bp_code;

const char *bp_type_name(uint32_t type);
/* Whether a node of that role ever receives the type (prefill: true for the
 * decode's messages). Checked on the header, before any payload is read. */
bool bp_type_for_role(uint32_t type, bool prefill);
const char *bp_code_name(uint32_t code);

typedef struct bp_header {
    uint32_t magic;
    uint16_t version, type;
    uint32_t flags, length;
} bp_header;

/* Little-endian accessors (unaligned-safe). */
uint16_t bp_get_u16(const uint8_t *p);
uint32_t bp_get_u32(const uint8_t *p);
uint64_t bp_get_u64(const uint8_t *p);
void bp_put_u16(uint8_t *p, uint16_t v);
void bp_put_u32(uint8_t *p, uint32_t v);
void bp_put_u64(uint8_t *p, uint64_t v);

/* Parses and validates 16 header bytes. On failure *code says what to put
 * in the error reply (the connection is then closed). */
pd_err bp_header_check(const uint8_t *buf, bp_header *out, bp_code *code);
void bp_header_write(uint8_t *buf, bp_type type, uint32_t length);

/* ---- messages ------------------------------------------------------------ */

enum { BP_REG_KV = 0, BP_REG_MAMBA = 1, BP_REG_META = 2, BP_REG_COUNT = 3 };

typedef struct bp_region {
    uint64_t base;          /* remote virtual address of unit 0 */
    uint64_t unit_bytes;
    uint32_t units;         /* 0: no such region */
    uint16_t rkey_len;
    const uint8_t *rkey;    /* packed UCX remote key */
} bp_region;

typedef struct bp_hello {
    uint64_t node_id;
    uint32_t page_size;
    uint32_t meta_row_bytes;
    const uint8_t *proof; /* read: BP_PROOF_BYTES into the payload; write: ignored */
    uint16_t worker_addr_len;
    const uint8_t *worker_addr;
    bp_region region[BP_REG_COUNT];
} bp_hello;

typedef struct bp_dest {
    uint64_t room;
    uint32_t prompt_tokens, cached_tokens;
    uint32_t mamba_slot, meta_row;   /* BP_NONE: none */
    uint32_t n_pages;
    const uint8_t *pages;            /* n_pages little-endian u32, read with bp_dest_page */
} bp_dest;

#define BP_ERROR_FLAG_ROOM 1u

typedef struct bp_error {
    uint32_t code;
    bool has_room;                   /* false: about the connection */
    uint64_t room;
    uint16_t text_len;
    const uint8_t *text;             /* not NUL-terminated */
} bp_error;

/* ---- authentication --------------------------------------------------------
 *
 * The token (a shared secret, possibly empty) never crosses the wire. Each
 * side proves it holds it with an HMAC-SHA-256 keyed by the token over both
 * sides' fresh nonces, a label that differs per side (so one side's proof is
 * never valid as the other's), and for the decode node the whole HELLO, so
 * its worker address and keys cannot be swapped by someone without the
 * token. The decode node speaks first (AUTH: its nonce); the prefill answers
 * CHALLENGE (its nonce, its proof); the decode node checks that proof before
 * it discloses its memory in HELLO, which carries its own proof. With no
 * token configured the key is empty: anyone can compute the proofs, and a
 * side with a token refuses a side without one. libsodium does the HMAC and
 * the constant-time comparison. */
typedef struct bp_auth {
    const uint8_t *key; /* the token */
    size_t key_len;
    uint8_t nonce_decode[BP_NONCE_BYTES], nonce_prefill[BP_NONCE_BYTES];
} bp_auth;

void bp_prefill_proof(const bp_auth *a, uint8_t out[BP_PROOF_BYTES]);
/* The decode node's proof over a HELLO payload (its proof field read as zero). */
void bp_hello_proof(const bp_auth *a, const uint8_t *payload, uint32_t len,
                    uint8_t out[BP_PROOF_BYTES]);
bool bp_hello_verify(const bp_auth *a, const uint8_t *payload, uint32_t len);
bool bp_proof_equal(const uint8_t a[BP_PROOF_BYTES], const uint8_t b[BP_PROOF_BYTES]);

/* Encoders write a whole message (header included) into out[0, cap) and
 * return its size, or 0 if it does not fit or a field is out of range.
 * bp_hello_write signs the HELLO with a's key and nonces. */
size_t bp_auth_write(uint8_t *out, size_t cap, const uint8_t nonce[BP_NONCE_BYTES]);
size_t bp_challenge_write(uint8_t *out, size_t cap, const uint8_t nonce[BP_NONCE_BYTES],
                          const uint8_t proof[BP_PROOF_BYTES]);
size_t bp_hello_write(uint8_t *out, size_t cap, const bp_hello *h, const bp_auth *a);
size_t bp_hello_ok_write(uint8_t *out, size_t cap, uint64_t node_id, uint32_t page_size);
/* pages are host-order uint32 values. */
size_t bp_dest_write(uint8_t *out, size_t cap, uint64_t room, uint32_t prompt_tokens,
                     uint32_t cached_tokens, uint32_t mamba_slot, uint32_t meta_row,
                     const uint32_t *pages, uint32_t n_pages);
/* DEST_OK, START, DONE, ABORT, ACK: a room and one 64-bit value (DONE: bytes
 * written; ABORT: reason; others: 0). */
size_t bp_room_write(uint8_t *out, size_t cap, bp_type type, uint64_t room, uint64_t value);
size_t bp_ping_write(uint8_t *out, size_t cap);
size_t bp_error_write(uint8_t *out, size_t cap, bp_code code, bool has_room, uint64_t room,
                      const char *text);

/* Decoders take the payload (after the header) and its length. */
pd_err bp_auth_read(const uint8_t *p, uint32_t len, uint8_t nonce[BP_NONCE_BYTES]);
pd_err bp_challenge_read(const uint8_t *p, uint32_t len, uint8_t nonce[BP_NONCE_BYTES],
                         uint8_t proof[BP_PROOF_BYTES]);
pd_err bp_hello_read(const uint8_t *p, uint32_t len, bp_hello *out);
pd_err bp_hello_ok_read(const uint8_t *p, uint32_t len, uint64_t *node_id, uint32_t *page_size);
pd_err bp_dest_read(const uint8_t *p, uint32_t len, bp_dest *out);
static inline uint32_t bp_dest_page(const bp_dest *d, uint32_t i) {
    return bp_get_u32(d->pages + 4u * (size_t)i);
}
size_t bp_notice_write(uint8_t *out, uint64_t room, uint64_t bytes, uint64_t node_id);
pd_err bp_notice_read(const uint8_t *p, size_t len, uint64_t *room, uint64_t *bytes,
                      uint64_t *node_id);
/* One segment of a data-bearing notice (BP_AM_NOTICE_DATA). */
typedef struct bp_notice_seg {
    uint32_t region; /* BP_REG_* */
    uint32_t index;  /* KV: first position in the destination page list; else 0 */
    uint32_t units;  /* KV: pages; else 1 */
} bp_notice_seg;

typedef struct bp_notice {
    uint64_t room, bytes, node_id;
    uint32_t n_segs; /* 0: a plain notice (BP_AM_NOTICE) */
    bp_notice_seg segs[BP_NOTICE_SEGS_MAX];
} bp_notice;

/* The header of a data-bearing notice, into out (at least
 * BP_NOTICE_DATA_HEADER_MAX bytes); its length, or 0 if n_segs is 0 or over
 * BP_NOTICE_SEGS_MAX. */
size_t bp_notice_data_write(uint8_t *out, const bp_notice *nt);
/* Parses and checks a data-bearing notice's header: its length is exactly
 * what the segment count says, 1..BP_NOTICE_SEGS_MAX segments, reserved
 * fields zero, known regions, at least one unit each, and a Mamba or
 * metadata segment is index 0, one unit. Whether the segments fit the room
 * is the receiver's to check (it knows the destination). */
pd_err bp_notice_data_read(const uint8_t *p, size_t len, bp_notice *out);
pd_err bp_room_read(const uint8_t *p, uint32_t len, uint64_t *room, uint64_t *value);
pd_err bp_error_read(const uint8_t *p, uint32_t len, bp_error *out);

#endif /* PDSERVE_XFER_BOOTSTRAP_PROTO_H */
