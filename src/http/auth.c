/*
 * auth.c — the API key of --api-key: which requests need it, and the check of
 * "Authorization: Bearer KEY". Nodes and the router call the same code.
 *
 * Which routes. SGLang's add_api_key_middleware lets through every OPTIONS
 * request (CORS preflights), every path starting with /health and every path
 * starting with /metrics, so that load balancers and Prometheus need no
 * secret; everything else, unknown paths included, needs the key. We do the
 * same, so a deployment moved from SGLang keeps its probes and scrapes.
 *
 * How. Both the key and the token a client sent are hashed (BLAKE2b,
 * libsodium's generichash, 32 bytes) and the digests compared with
 * crypto_verify_32, so the time a refusal takes says nothing about how many
 * bytes of the key were right, nor about its length. Never hand-written
 * crypto; never memcmp on a secret.
 */
#include <sodium.h>
#include <string.h>
#include <strings.h>

#include "pdserve/base.h"
#include "pdserve/http.h"
#include "pdserve/http_server.h"

bool pd_http_api_key_valid(const char *key) {
    if (!key) return false;
    size_t n = strlen(key);
    if (n == 0 || n >= PD_HTTP_API_KEY_MAX) return false;
    /* Visible ASCII only: the router sends it in a header of its own. */
    for (size_t i = 0; i < n; i++)
        if (key[i] <= 0x20 || key[i] >= 0x7f) return false;
    return true;
}

bool pd_http_api_key_exempt(const char *method, const char *path) {
    PD_ASSERT(method && path);
    return !strcmp(method, "OPTIONS") || !strncmp(path, "/health", 7) ||
        !strncmp(path, "/metrics", 8);
}

/* BLAKE2b of s, 32 bytes: equal digests for equal strings only. */
static void digest(const char *s, unsigned char out[crypto_verify_32_BYTES]) {
    crypto_generichash(out, crypto_verify_32_BYTES, (const unsigned char *)s, strlen(s), NULL, 0);
}

bool pd_http_bearer_matches(const char *authorization, const char *api_key) {
    PD_ASSERT(api_key && api_key[0]);
    if (!authorization || sodium_init() < 0) return false;
    /* "Bearer" is a case-insensitive scheme name (RFC 7235); the token is
     * what follows the spaces after it. */
    if (strncasecmp(authorization, "Bearer ", 7)) return false;
    const char *token = authorization + 7;
    while (*token == ' ') token++;
    unsigned char a[crypto_verify_32_BYTES], b[crypto_verify_32_BYTES];
    digest(token, a);
    digest(api_key, b);
    return crypto_verify_32(a, b) == 0;
}

bool pd_http_req_authorize(pd_http_req *r, const char *api_key) {
    if (!api_key || !api_key[0]) return true;
    if (pd_http_api_key_exempt(pd_http_req_method(r), pd_http_req_path(r))) return true;
    const char *got = pd_http_req_header(r, "Authorization");
    if (pd_http_bearer_matches(got, api_key)) return true;
    pd_http_req_add_header(r, "WWW-Authenticate", "Bearer");
    if (!got)
        pd_http_req_respond_error(r, 401,
                                  "this server needs an API key: send the header "
                                  "'Authorization: Bearer KEY' (the server's --api-key)");
    else
        pd_http_req_respond_error(r, 401,
                                  "the API key is not valid (the header must be "
                                  "'Authorization: Bearer KEY' with the server's --api-key)");
    return false;
}
