/* Replays a fuzz target's corpus: every file named, or every file in every
 * directory named, through LLVMFuzzerTestOneInput once. A crash or a
 * sanitizer report fails the test; a directory without files fails it too
 * (a corpus that went missing must not pass silently). */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz.h"

static int replay_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "replay: cannot open %s\n", path);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc(len > 0 ? (size_t)len : 1);
    size_t got = buf ? fread(buf, 1, (size_t)(len > 0 ? len : 0), f) : 0;
    fclose(f);
    if (!buf || got != (size_t)(len > 0 ? len : 0)) {
        fprintf(stderr, "replay: cannot read %s\n", path);
        free(buf);
        return 1;
    }
    LLVMFuzzerTestOneInput(buf, got);
    free(buf);
    return 0;
}

int main(int argc, char **argv) {
    unsigned files = 0;
    for (int i = 1; i < argc; i++) {
        struct stat sb;
        if (stat(argv[i], &sb) != 0) {
            fprintf(stderr, "replay: no such file or directory: %s\n", argv[i]);
            return 1;
        }
        if (!S_ISDIR(sb.st_mode)) {
            if (replay_file(argv[i])) return 1;
            files++;
            continue;
        }
        DIR *d = opendir(argv[i]);
        if (!d) return 1;
        for (struct dirent *e; (e = readdir(d)) != NULL;) {
            if (e->d_name[0] == '.') continue;
            char path[4096];
            snprintf(path, sizeof(path), "%s/%s", argv[i], e->d_name);
            if (replay_file(path)) {
                closedir(d);
                return 1;
            }
            files++;
        }
        closedir(d);
    }
    printf("replay: %u inputs, no crash\n", files);
    return files ? 0 : 1;
}
