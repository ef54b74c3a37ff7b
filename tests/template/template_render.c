/* template_render TEMPLATE CONTEXT.json: renders a chat template with
 * pd_chat_template and writes the bytes to stdout. On failure it writes the
 * error message alone (no newline, so reference.sh can compare it with the
 * reference's) to stderr and exits 1. */
#include <stdio.h>
#include <stdlib.h>

#include "pdserve/chat_template.h"

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    if (fseek(f, 0, SEEK_END) == 0) {
        long n = ftell(f);
        if (n >= 0 && fseek(f, 0, SEEK_SET) == 0 && (buf = malloc((size_t)n + 1)) != NULL) {
            *len = fread(buf, 1, (size_t)n, f);
            buf[*len] = 0;
        }
    }
    fclose(f);
    return buf;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: template_render TEMPLATE CONTEXT.json\n");
        return 2;
    }
    size_t len = 0;
    char *src = read_file(argv[1], &len), msg[512] = "", *out = NULL;
    json_error_t jerr;
    json_t *ctx = json_load_file(argv[2], 0, &jerr);
    if (!src || !ctx) {
        fprintf(stderr, "template_render: cannot read %s\n", !src ? argv[1] : argv[2]);
        return 2;
    }
    pd_chat_template *t = NULL;
    size_t out_len = 0;
    pd_err err = pd_chat_template_compile(src, len, &t, msg, sizeof(msg));
    if (!err) err = pd_chat_template_render(t, ctx, &out, &out_len, msg, sizeof(msg));
    if (!err) fwrite(out, 1, out_len, stdout);
    if (err) fputs(msg, stderr);
    free(out);
    pd_chat_template_free(t);
    json_decref(ctx);
    free(src);
    return err ? 1 : 0;
}
