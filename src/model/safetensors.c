/*
 * safetensors.c — strict reader and simple writer. See
 * include/pdserve/safetensors.h for the format and the checks.
 *
 * The reader works in three steps, each of which can refuse the file:
 *   1. framing: the 8-byte length, its bound, and that it fits in the file;
 *   2. the header: JSON parsed by jansson (which also rejects invalid UTF-8
 *      and, with JSON_REJECT_DUPLICATES, repeated names), then every entry
 *      checked field by field with overflow-checked arithmetic;
 *   3. the layout: entries sorted by offset must tile [0, data_bytes).
 * Integers in the header are read as jansson's json_int_t (64-bit signed);
 * a value jansson cannot represent is a JSON error, a negative one is ours.
 */
#include "pdserve/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static const struct {
    const char *name;
    size_t bytes;
} dtype_table[PD_DTYPE__COUNT] = {
    [PD_DTYPE_BOOL] = {"BOOL", 1},       [PD_DTYPE_U8] = {"U8", 1},
    [PD_DTYPE_I8] = {"I8", 1},           [PD_DTYPE_F8_E4M3] = {"F8_E4M3", 1},
    [PD_DTYPE_F8_E5M2] = {"F8_E5M2", 1}, [PD_DTYPE_I16] = {"I16", 2},
    [PD_DTYPE_U16] = {"U16", 2},         [PD_DTYPE_F16] = {"F16", 2},
    [PD_DTYPE_BF16] = {"BF16", 2},       [PD_DTYPE_I32] = {"I32", 4},
    [PD_DTYPE_U32] = {"U32", 4},         [PD_DTYPE_F32] = {"F32", 4},
    [PD_DTYPE_F64] = {"F64", 8},         [PD_DTYPE_I64] = {"I64", 8},
    [PD_DTYPE_U64] = {"U64", 8},
};

const char *pd_dtype_name(pd_dtype dtype) {
    if ((unsigned)dtype >= PD_DTYPE__COUNT) return "unknown";
    return dtype_table[dtype].name;
}

size_t pd_dtype_bytes(pd_dtype dtype) {
    if ((unsigned)dtype >= PD_DTYPE__COUNT) return 0;
    return dtype_table[dtype].bytes;
}

bool pd_dtype_parse(const char *name, pd_dtype *out) {
    for (int d = 0; d < PD_DTYPE__COUNT; d++) {
        if (!strcmp(name, dtype_table[d].name)) {
            *out = (pd_dtype)d;
            return true;
        }
    }
    return false;
}

/* ---- scalar conversions ------------------------------------------------- */

static float f32_from_bits(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

static uint32_t f32_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof(bits));
    return bits;
}

float pd_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0) {
        /* zero or subnormal: man * 2^-24, exact in fp32 */
        float v = (float)man * 0x1p-24f;
        return sign ? -v : v;
    }
    if (exp == 31) return f32_from_bits(sign | 0x7f800000u | (man << 13));
    return f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

float pd_bf16_to_f32(uint16_t b) { return f32_from_bits((uint32_t)b << 16); }

uint16_t pd_f32_to_f16(float f) {
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t exp = (x >> 23) & 0xffu;
    uint32_t man = x & 0x7fffffu;
    if (exp == 0xff) /* inf stays inf, NaN stays a quiet NaN */
        return (uint16_t)(sign | 0x7c00u | (man ? 0x200u | (man >> 13) : 0u));
    int32_t e = (int32_t)exp - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7c00u);
    if (e <= 0) {
        /* half subnormal k * 2^-24 with k = man24 * 2^(e - 14) */
        if (e < -10) return sign;
        uint32_t man24 = man | 0x800000u;
        uint32_t shift = (uint32_t)(14 - e);
        uint32_t k = man24 >> shift;
        uint32_t rem = man24 & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (k & 1u))) k++;
        return (uint16_t)(sign | k);
    }
    uint32_t h = ((uint32_t)e << 10) | (man >> 13);
    uint32_t rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++; /* carry may reach inf */
    return (uint16_t)(sign | h);
}

uint16_t pd_f32_to_bf16(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* ---- reader ------------------------------------------------------------- */

static uint64_t load_le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* Non-negative JSON integer, else false. */
static bool json_u64(const json_t *v, uint64_t *out) {
    if (!json_is_integer(v)) return false;
    json_int_t i = json_integer_value(v);
    if (i < 0) return false;
    *out = (uint64_t)i;
    return true;
}

static pd_err parse_entry(pd_st_tensor *t, const char *name, const json_t *v,
                          uint64_t data_bytes, char *msg, size_t cap) {
    size_t name_len = strlen(name);
    if (name_len == 0) return pd_errorf(msg, cap, PD_ERR_PARSE, "a tensor has an empty name");
    if (name_len >= PD_ST_NAME_BYTES_MAX)
        return pd_errorf(msg, cap, PD_ERR_PARSE, "tensor '%.40s...': name longer than %d bytes",
                         name, PD_ST_NAME_BYTES_MAX - 1);
    memcpy(t->name, name, name_len + 1);
    if (!json_is_object(v))
        return pd_errorf(msg, cap, PD_ERR_PARSE, "tensor '%s': entry is not an object", name);
    if (json_object_size(v) != 3)
        return pd_errorf(msg, cap, PD_ERR_PARSE,
                         "tensor '%s': entry must have exactly dtype, shape and data_offsets",
                         name);

    const json_t *dt = json_object_get(v, "dtype");
    if (!json_is_string(dt))
        return pd_errorf(msg, cap, PD_ERR_PARSE, "tensor '%s': dtype missing or not a string",
                         name);
    if (!pd_dtype_parse(json_string_value(dt), &t->dtype))
        return pd_errorf(msg, cap, PD_ERR_PARSE, "tensor '%s': unknown dtype '%.32s'", name,
                         json_string_value(dt));

    const json_t *shape = json_object_get(v, "shape");
    if (!json_is_array(shape))
        return pd_errorf(msg, cap, PD_ERR_PARSE, "tensor '%s': shape missing or not an array",
                         name);
    size_t ndim = json_array_size(shape);
    if (ndim > PD_ST_NDIM_MAX)
        return pd_errorf(msg, cap, PD_ERR_PARSE, "tensor '%s': %zu dimensions (at most %d)", name,
                         ndim, PD_ST_NDIM_MAX);
    t->ndim = (uint32_t)ndim;
    t->elems = 1;
    for (size_t i = 0; i < ndim; i++) {
        if (!json_u64(json_array_get(shape, i), &t->shape[i]))
            return pd_errorf(msg, cap, PD_ERR_PARSE,
                             "tensor '%s': shape[%zu] is not a non-negative integer", name, i);
        if (t->shape[i] != 0 && t->elems > UINT64_MAX / t->shape[i])
            return pd_errorf(msg, cap, PD_ERR_PARSE, "tensor '%s': element count overflows", name);
        t->elems *= t->shape[i];
    }
    uint64_t elem_bytes = pd_dtype_bytes(t->dtype);
    if (t->elems > UINT64_MAX / elem_bytes)
        return pd_errorf(msg, cap, PD_ERR_PARSE, "tensor '%s': byte size overflows", name);
    uint64_t bytes = t->elems * elem_bytes;

    const json_t *off = json_object_get(v, "data_offsets");
    if (!json_is_array(off) || json_array_size(off) != 2)
        return pd_errorf(msg, cap, PD_ERR_PARSE,
                         "tensor '%s': data_offsets missing or not a [begin, end] pair", name);
    if (!json_u64(json_array_get(off, 0), &t->begin) || !json_u64(json_array_get(off, 1), &t->end))
        return pd_errorf(msg, cap, PD_ERR_PARSE,
                         "tensor '%s': data_offsets are not non-negative integers", name);
    if (t->end < t->begin)
        return pd_errorf(msg, cap, PD_ERR_PARSE,
                         "tensor '%s': data_offsets [%llu, %llu] end before begin", name,
                         (unsigned long long)t->begin, (unsigned long long)t->end);
    if (t->end - t->begin != bytes)
        return pd_errorf(
            msg, cap, PD_ERR_PARSE,
            "tensor '%s': data_offsets span %llu bytes but %s with %llu elements needs %llu", name,
            (unsigned long long)(t->end - t->begin), pd_dtype_name(t->dtype),
            (unsigned long long)t->elems, (unsigned long long)bytes);
    if (t->end > data_bytes)
        return pd_errorf(msg, cap, PD_ERR_PARSE,
                         "tensor '%s': data_offsets end %llu is past the data buffer (%llu bytes)",
                         name, (unsigned long long)t->end, (unsigned long long)data_bytes);
    return PD_OK;
}

static int cmp_by_offset(const void *a, const void *b) {
    const pd_st_tensor *x = *(const pd_st_tensor *const *)a;
    const pd_st_tensor *y = *(const pd_st_tensor *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* Sorted by (begin, end), the tensors must tile [0, data_bytes) exactly.
 * A zero-byte tensor must sit exactly on a boundary, as in the reference
 * reader. */
static pd_err check_layout(const pd_safetensors *st, char *msg, size_t cap) {
    if (st->n_tensors == 0) {
        if (st->data_bytes != 0)
            return pd_errorf(msg, cap, PD_ERR_PARSE, "%llu data bytes but no tensors",
                             (unsigned long long)st->data_bytes);
        return PD_OK;
    }
    const pd_st_tensor **order = malloc(sizeof(*order) * st->n_tensors);
    if (!order) return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory indexing tensors");
    for (uint32_t i = 0; i < st->n_tensors; i++) order[i] = &st->tensors[i];
    qsort(order, st->n_tensors, sizeof(*order), cmp_by_offset);
    pd_err err = PD_OK;
    uint64_t covered = 0;
    const pd_st_tensor *prev = NULL;
    for (uint32_t i = 0; i < st->n_tensors && err == PD_OK; i++) {
        const pd_st_tensor *t = order[i];
        if (t->begin > covered)
            err = pd_errorf(
                msg, cap, PD_ERR_PARSE,
                "tensor '%s': gap of %llu unused bytes before its data_offsets [%llu, %llu]",
                t->name, (unsigned long long)(t->begin - covered), (unsigned long long)t->begin,
                (unsigned long long)t->end);
        else if (t->begin < covered)
            err = pd_errorf(
                msg, cap, PD_ERR_PARSE,
                "tensor '%s': data_offsets [%llu, %llu] overlap tensor '%s' [%llu, %llu]", t->name,
                (unsigned long long)t->begin, (unsigned long long)t->end, prev->name,
                (unsigned long long)prev->begin, (unsigned long long)prev->end);
        covered = t->end;
        prev = t;
    }
    if (err == PD_OK && covered != st->data_bytes)
        err = pd_errorf(msg, cap, PD_ERR_PARSE,
                        "%llu bytes after the last tensor ('%s') are not covered by any tensor",
                        (unsigned long long)(st->data_bytes - covered), prev ? prev->name : "?");
    free(order);
    return err;
}

static pd_err check_metadata(const json_t *v, char *msg, size_t cap) {
    if (!json_is_object(v))
        return pd_errorf(msg, cap, PD_ERR_PARSE, "__metadata__ is not an object");
    const char *k;
    json_t *val;
    json_object_foreach((json_t *)v, k, val) {
        if (!json_is_string(val))
            return pd_errorf(msg, cap, PD_ERR_PARSE, "__metadata__ entry '%.64s' is not a string",
                             k);
    }
    return PD_OK;
}

pd_err pd_safetensors_parse(pd_safetensors *st, const uint8_t *bytes, size_t size, char *msg,
                            size_t cap) {
    PD_ASSERT(st != NULL);
    memset(st, 0, sizeof(*st));
    if (!bytes && size > 0) return pd_errorf(msg, cap, PD_ERR_INVALID, "no buffer");
    if (size < 8)
        return pd_errorf(msg, cap, PD_ERR_PARSE,
                         "file is %zu bytes, shorter than the 8-byte header length", size);
    uint64_t hlen = load_le64(bytes);
    if (hlen > PD_ST_HEADER_BYTES_MAX)
        return pd_errorf(msg, cap, PD_ERR_PARSE,
                         "header length %llu exceeds the limit of %llu bytes",
                         (unsigned long long)hlen, (unsigned long long)PD_ST_HEADER_BYTES_MAX);
    if (hlen > size - 8)
        return pd_errorf(msg, cap, PD_ERR_PARSE,
                         "header length %llu runs past the end of the file (%zu bytes)",
                         (unsigned long long)hlen, size);
    if (hlen < 2 || bytes[8] != '{')
        return pd_errorf(msg, cap, PD_ERR_PARSE, "header does not start with a JSON object");

    json_error_t jerr;
    json_t *root = json_loadb((const char *)bytes + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return pd_errorf(msg, cap, PD_ERR_PARSE,
                         "header is not valid JSON: %s (line %d, column %d)", jerr.text, jerr.line,
                         jerr.column);
    pd_err err = PD_OK;
    if (!json_is_object(root)) {
        err = pd_errorf(msg, cap, PD_ERR_PARSE, "header is not a JSON object");
        goto out;
    }
    size_t n = json_object_size(root);
    if (n > PD_ST_TENSORS_MAX + 1) {
        err = pd_errorf(msg, cap, PD_ERR_PARSE, "header lists %zu entries (at most %u tensors)", n,
                        PD_ST_TENSORS_MAX);
        goto out;
    }
    st->data = bytes + 8 + hlen;
    st->data_bytes = (uint64_t)size - 8 - hlen;
    st->tensors = n ? calloc(n, sizeof(pd_st_tensor)) : NULL;
    if (n && !st->tensors) {
        err = pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory for %zu tensor entries", n);
        goto out;
    }
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        if (!strcmp(key, "__metadata__")) {
            err = check_metadata(val, msg, cap);
        } else {
            err = parse_entry(&st->tensors[st->n_tensors], key, val, st->data_bytes, msg, cap);
            if (err == PD_OK) st->n_tensors++;
        }
        if (err != PD_OK) goto out;
    }
    err = check_layout(st, msg, cap);
out:
    json_decref(root);
    if (err != PD_OK) pd_safetensors_close(st);
    return err;
}

/* The file is mapped, not read: a checkpoint's bytes are paged in as the
 * loader converts them, and never held twice. (The mapping is private and
 * read-only; a file truncated by someone else while mapped would fault, so
 * the loader converts and closes at once.) */
pd_err pd_safetensors_open(pd_safetensors *st, const char *path, uint64_t file_bytes_max,
                           char *msg, size_t cap) {
    PD_ASSERT(st != NULL && path != NULL);
    memset(st, 0, sizeof(*st));
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return pd_errorf(msg, cap, PD_ERR_IO, "%s: %s", path, strerror(errno));
    struct stat sb;
    pd_err err = PD_OK;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        err = pd_errorf(msg, cap, PD_ERR_IO, "%s: not a regular file", path);
    } else if ((uint64_t)sb.st_size > file_bytes_max) {
        err = pd_errorf(msg, cap, PD_ERR_TOOBIG, "%s: %lld bytes, more than the limit of %llu",
                        path, (long long)sb.st_size, (unsigned long long)file_bytes_max);
    } else if (sb.st_size == 0) {
        static const uint8_t empty[1];
        err = pd_safetensors_parse(st, empty, 0, msg, cap);
    } else {
        void *map = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) {
            err = pd_errorf(msg, cap, PD_ERR_IO, "%s: cannot map %lld bytes: %s", path,
                            (long long)sb.st_size, strerror(errno));
        } else {
            err = pd_safetensors_parse(st, map, (size_t)sb.st_size, msg, cap);
            if (err == PD_OK) {
                st->mapped = map;
                st->mapped_bytes = (size_t)sb.st_size;
            } else {
                munmap(map, (size_t)sb.st_size);
            }
        }
    }
    close(fd);
    return err;
}

void pd_safetensors_close(pd_safetensors *st) {
    if (!st) return;
    free(st->tensors);
    if (st->mapped) munmap(st->mapped, st->mapped_bytes);
    memset(st, 0, sizeof(*st));
}

const pd_st_tensor *pd_safetensors_find(const pd_safetensors *st, const char *name) {
    for (uint32_t i = 0; i < st->n_tensors; i++)
        if (!strcmp(st->tensors[i].name, name)) return &st->tensors[i];
    return NULL;
}

pd_err pd_safetensors_read_f32(const pd_safetensors *st, const pd_st_tensor *t, float *out,
                               uint64_t n, char *msg, size_t cap) {
    PD_ASSERT(t->end <= st->data_bytes && t->begin <= t->end);
    if (n != t->elems)
        return pd_errorf(msg, cap, PD_ERR_INVALID,
                         "tensor '%s': %llu elements, caller expects %llu", t->name,
                         (unsigned long long)t->elems, (unsigned long long)n);
    const uint8_t *p = st->data + t->begin;
    switch (t->dtype) {
    case PD_DTYPE_F32:
        for (uint64_t i = 0; i < n; i++, p += 4)
            out[i] = f32_from_bits((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                                   (uint32_t)p[3] << 24);
        return PD_OK;
    case PD_DTYPE_F16:
        for (uint64_t i = 0; i < n; i++, p += 2)
            out[i] = pd_f16_to_f32((uint16_t)(p[0] | p[1] << 8));
        return PD_OK;
    case PD_DTYPE_BF16:
        for (uint64_t i = 0; i < n; i++, p += 2)
            out[i] = pd_bf16_to_f32((uint16_t)(p[0] | p[1] << 8));
        return PD_OK;
    default:
        return pd_errorf(msg, cap, PD_ERR_INVALID,
                         "tensor '%s': dtype %s not accepted (F32, F16 or BF16)", t->name,
                         pd_dtype_name(t->dtype));
    }
}

/* ---- writer ------------------------------------------------------------- */

static uint64_t input_elems(const pd_st_input *t) {
    uint64_t e = 1;
    for (uint32_t d = 0; d < t->ndim; d++) e *= t->shape[d];
    return e;
}

static bool write_values(FILE *f, const float *v, uint64_t n, pd_dtype dtype) {
    uint8_t buf[4096];
    size_t fill = 0, width = pd_dtype_bytes(dtype);
    for (uint64_t i = 0; i < n; i++) {
        uint32_t bits = dtype == PD_DTYPE_F32    ? f32_bits(v[i])
                        : dtype == PD_DTYPE_F16  ? pd_f32_to_f16(v[i])
                                                 : pd_f32_to_bf16(v[i]);
        for (size_t b = 0; b < width; b++) buf[fill++] = (uint8_t)(bits >> (8 * b));
        if (fill + 4 > sizeof(buf)) {
            if (fwrite(buf, 1, fill, f) != fill) return false;
            fill = 0;
        }
    }
    return fill == 0 || fwrite(buf, 1, fill, f) == fill;
}

pd_err pd_safetensors_write(const char *path, const pd_st_input *tensors, uint32_t n,
                            pd_dtype dtype, char *msg, size_t cap) {
    if (dtype != PD_DTYPE_F32 && dtype != PD_DTYPE_F16 && dtype != PD_DTYPE_BF16)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "cannot write dtype %s (F32, F16 or BF16)",
                         pd_dtype_name(dtype));
    json_t *root = json_object();
    if (!root) return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory");
    uint64_t off = 0;
    pd_err err = PD_OK;
    for (uint32_t i = 0; i < n && err == PD_OK; i++) {
        const pd_st_input *t = &tensors[i];
        if (t->ndim > PD_ST_NDIM_MAX || !t->name || !t->name[0]) {
            err = pd_errorf(msg, cap, PD_ERR_INVALID, "tensor %u: bad name or rank", i);
            break;
        }
        uint64_t bytes = input_elems(t) * pd_dtype_bytes(dtype);
        json_t *shape = json_array();
        for (uint32_t d = 0; d < t->ndim; d++)
            json_array_append_new(shape, json_integer((json_int_t)t->shape[d]));
        json_t *entry = json_pack("{s:s, s:o, s:[I,I]}", "dtype", pd_dtype_name(dtype), "shape",
                                  shape, "data_offsets", (json_int_t)off,
                                  (json_int_t)(off + bytes));
        if (!entry || json_object_set_new(root, t->name, entry) != 0)
            err = pd_errorf(msg, cap, PD_ERR_INVALID, "tensor '%s': cannot add to header", t->name);
        off += bytes;
    }
    char *header = NULL;
    if (err == PD_OK) {
        header = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
        if (!header) err = pd_errorf(msg, cap, PD_ERR_NOMEM, "cannot serialise the header");
    }
    json_decref(root);
    if (err != PD_OK) {
        free(header);
        return err;
    }
    size_t hlen = strlen(header);
    size_t padded = (hlen + 7) / 8 * 8;
    FILE *f = fopen(path, "wb");
    if (!f) {
        free(header);
        return pd_errorf(msg, cap, PD_ERR_IO, "%s: %s", path, strerror(errno));
    }
    uint8_t len_le[8];
    for (int b = 0; b < 8; b++) len_le[b] = (uint8_t)((uint64_t)padded >> (8 * b));
    bool ok = fwrite(len_le, 1, 8, f) == 8 && fwrite(header, 1, hlen, f) == hlen;
    for (size_t i = hlen; ok && i < padded; i++) ok = fputc(' ', f) != EOF;
    for (uint32_t i = 0; ok && i < n; i++)
        ok = write_values(f, tensors[i].data, input_elems(&tensors[i]), dtype);
    free(header);
    if (fclose(f) != 0) ok = false;
    if (!ok) return pd_errorf(msg, cap, PD_ERR_IO, "%s: write failed", path);
    return PD_OK;
}
