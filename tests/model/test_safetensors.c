/* Model directories and the safetensors reader: a model written by init
 * loads back to the same weights and the same tokens (F32 exactly; F16 and
 * BF16 rounded to nearest even); every kind of malformed file and config is
 * refused with a message naming the tensor (or key) and the problem; and
 * thousands of random corruptions never crash the reader (ASan watches).
 * All fixtures are generated here, in a temporary directory. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "model_fixture.h"
#include "model_internal.h"

/* ---- helpers ------------------------------------------------------------------- */

static char tmp_root[64];

static int setup(void **state) {
    (void)state;
    snprintf(tmp_root, sizeof(tmp_root), "/tmp/pd_model_test_XXXXXX");
    return mkdtemp(tmp_root) ? 0 : -1;
}

static void rm_model_dir(const char *dir) {
    char p[256];
    snprintf(p, sizeof(p), "%s/config.json", dir);
    unlink(p);
    snprintf(p, sizeof(p), "%s/model.safetensors", dir);
    unlink(p);
    snprintf(p, sizeof(p), "%s/model.safetensors.index.json", dir);
    unlink(p);
    for (int k = 1; k <= 9; k++)
        for (int n = 1; n <= 9; n++) {
            snprintf(p, sizeof(p), "%s/model-%05d-of-%05d.safetensors", dir, k, n);
            unlink(p);
        }
    rmdir(dir);
}

static int teardown(void **state) {
    (void)state;
    return rmdir(tmp_root); /* fails (and so does the run) if a test left files */
}

static void dir_path(char *out, size_t cap, const char *name) {
    snprintf(out, cap, "%s/%s", tmp_root, name);
}

static void file_path(char *out, size_t cap, const char *dir, const char *file) {
    snprintf(out, cap, "%s/%s", dir, file);
}

static uint8_t *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    *len = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc(*len ? *len : 1);
    assert_int_equal(fread(b, 1, *len, f), *len);
    fclose(f);
    return b;
}

static void write_all(const char *path, const void *b, size_t len) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(b, 1, len, f), len);
    fclose(f);
}

static pd_model *tiny_model(const char *layers, uint64_t seed) { return fx_model(layers, seed); }

/* Saves m into tmp_root/name. */
static void save(const pd_model *m, const char *name, pd_dtype dtype, char *dir, size_t cap) {
    char msg[300];
    dir_path(dir, cap, name);
    if (pd_model_save(m, dir, dtype, msg, sizeof(msg)) != PD_OK) fail_msg("save: %s", msg);
}

/* A safetensors image from a header text and data_bytes zero bytes. */
static uint8_t *image(const char *header, uint64_t hlen_field, size_t data_bytes, size_t *len) {
    size_t h = strlen(header);
    *len = 8 + h + data_bytes;
    uint8_t *b = calloc(1, *len);
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)(hlen_field >> (8 * i));
    memcpy(b + 8, header, h);
    return b;
}

/* ---- round trips --------------------------------------------------------------- */

static void f32_round_trip_gives_identical_weights_and_tokens(void **state) {
    (void)state;
    pd_model *m = tiny_model("MAMA", 31);
    char dir[128], msg[300];
    save(m, "f32", PD_DTYPE_F32, dir, sizeof(dir));
    pd_model *back = NULL;
    if (pd_model_load(&back, dir, msg, sizeof(msg)) != PD_OK) fail_msg("load: %s", msg);
    assert_memory_equal(pd_model_config_get(m), pd_model_config_get(back), sizeof(pd_model_config));
    assert_int_equal(pd_model_tensor_count(m), pd_model_tensor_count(back));
    for (uint32_t i = 0; i < pd_model_tensor_count(m); i++) {
        uint64_t n1, n2;
        const float *a = pd_model_tensor(m, pd_model_tensor_name(m, i), &n1);
        const float *b = pd_model_tensor(back, pd_model_tensor_name(m, i), &n2);
        assert_non_null(b);
        assert_int_equal(n1, n2);
        assert_memory_equal(a, b, n1 * sizeof(float));
    }
    /* and the same tokens */
    enum { LEN = 30 };
    int32_t prompt[LEN];
    fx_prompt(prompt, LEN, 3);
    uint32_t pages[8];
    fx_iota(pages, 8, 0);
    fx_run *r1 = calloc(1, sizeof(fx_run)), *r2 = calloc(1, sizeof(fx_run));
    pd_executor e1 = fx_exec(m, 8, 8, 1, 1), e2 = fx_exec(back, 8, 8, 1, 1);
    fx_run_request(&e1, prompt, LEN, 7, pages, 8, 0, 10, NULL, r1);
    fx_run_request(&e2, prompt, LEN, 7, pages, 8, 0, 10, NULL, r2);
    fx_assert_same(r1, r2);
    pd_model_executor_destroy(&e2);
    pd_model_executor_destroy(&e1);
    free(r2);
    free(r1);
    pd_model_destroy(back);
    pd_model_destroy(m);
    rm_model_dir(dir);
}

static void half_precision_files_load_rounded_weights(void **state) {
    (void)state;
    pd_model *m = tiny_model("MA", 32);
    const pd_dtype dtypes[] = {PD_DTYPE_F16, PD_DTYPE_BF16};
    for (size_t d = 0; d < 2; d++) {
        char dir[128], msg[300];
        save(m, dtypes[d] == PD_DTYPE_F16 ? "f16" : "bf16", dtypes[d], dir, sizeof(dir));
        pd_model *back = NULL;
        if (pd_model_load(&back, dir, msg, sizeof(msg)) != PD_OK) fail_msg("load: %s", msg);
        uint64_t differ = 0, kept = 0;
        for (uint32_t i = 0; i < pd_model_tensor_count(m); i++) {
            uint64_t n;
            const char *name = pd_model_tensor_name(m, i);
            const float *a = pd_model_tensor(m, name, &n);
            float *b = malloc(n * sizeof(float));
            assert_int_equal(pd_model_tensor_values(back, name, b, n), n);
            /* BF16 matrices stay bf16 in memory (widened by the kernels);
             * vectors, the conv kernel and every F16 tensor become fp32 */
            bool want_bf16 = dtypes[d] == PD_DTYPE_BF16 && strstr(name, "weight") &&
                !strstr(name, "norm") && !strstr(name, "conv1d");
            assert_int_equal(pd_model_tensor_is_bf16(back, name), want_bf16);
            assert_true(want_bf16 == (pd_model_tensor(back, name, NULL) == NULL));
            kept += want_bf16;
            for (uint64_t k = 0; k < n; k++) {
                float want = dtypes[d] == PD_DTYPE_F16 ? pd_f16_to_f32(pd_f32_to_f16(a[k]))
                                                       : pd_bf16_to_f32(pd_f32_to_bf16(a[k]));
                assert_memory_equal(&b[k], &want, sizeof(float));
                differ += b[k] != a[k];
            }
            free(b);
        }
        assert_true(differ > 0); /* the file really was in half precision */
        assert_true(dtypes[d] == PD_DTYPE_F16 ? kept == 0 : kept > 0);
        pd_model_destroy(back);
        rm_model_dir(dir);
    }
    pd_model_destroy(m);
}

/* ---- malformed files: the format ---------------------------------------------------- */

typedef struct bad_file {
    const char *header;
    size_t data_bytes;
    const char *message;
} bad_file;

#define E8 "{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}"

static void malformed_headers_are_refused_with_their_message(void **state) {
    (void)state;
    char long_name[400];
    snprintf(long_name, sizeof(long_name), "{\"%0300d\":" E8 "}", 7);
    const bad_file cases[] = {
        {"{\"a\":{\"dtype\":\"F32\"", 0, "not valid JSON"},
        {"[1,2]", 0, "does not start with a JSON object"},
        {"{\"a\":" E8 ",\"a\":" E8 "}", 8, "duplicate"},
        {"{\"a\":{\"dtype\":\"F31\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
         "tensor 'a': unknown dtype 'F31'"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8,
         "tensor 'a': shape[0] is not a non-negative integer"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":\"2\",\"data_offsets\":[0,8]}}", 8,
         "tensor 'a': shape missing or not an array"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8,
         "tensor 'a': data_offsets missing or not a [begin, end] pair"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0.0,8]}}", 8,
         "tensor 'a': data_offsets are not non-negative integers"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,4]}}", 8,
         "tensor 'a': data_offsets [8, 4] end before begin"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8,
         "tensor 'a': data_offsets span 8 bytes but F32 with 3 elements needs 12"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 8,
         "tensor 'a': data_offsets end 16 is past the data buffer (8 bytes)"},
        {"{\"a\":" E8 ",\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}", 20,
         "tensor 'b': gap of 4 unused bytes"},
        {"{\"a\":" E8 ",\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12,
         "tensor 'b': data_offsets [4, 12] overlap tensor 'a' [0, 8]"},
        {"{\"a\":" E8 "}", 12, "4 bytes after the last tensor ('a')"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1}}", 8,
         "tensor 'a': entry must have exactly dtype, shape and data_offsets"},
        {"{\"__metadata__\":{\"k\":1},\"a\":" E8 "}", 8, "__metadata__ entry 'k' is not a string"},
        {long_name, 8, "name longer than 255 bytes"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4,
         "tensor 'a': 9 dimensions"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],"
         "\"data_offsets\":[0,8]}}",
         8, "tensor 'a': element count overflows"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,99999999999999999999]}}", 8,
         "not valid JSON"},
        {"{\"a\":5}", 0, "tensor 'a': entry is not an object"},
        {"{\"\":" E8 "}", 8, "empty name"},
        {"{\"a\xff\":" E8 "}", 8, "not valid JSON"},
        {"{}", 4, "4 data bytes but no tensors"},
    };
    for (size_t i = 0; i < PD_ARRAY_LEN(cases); i++) {
        size_t len;
        uint8_t *b = image(cases[i].header, strlen(cases[i].header), cases[i].data_bytes, &len);
        pd_safetensors st;
        char msg[400] = "";
        pd_err err = pd_safetensors_parse(&st, b, len, msg, sizeof(msg));
        if (err == PD_OK) fail_msg("case %zu accepted", i);
        if (!strstr(msg, cases[i].message))
            fail_msg("case %zu: '%s' lacks '%s'", i, msg, cases[i].message);
        pd_safetensors_close(&st);
        free(b);
    }
}

static void bad_framing_is_refused_with_its_message(void **state) {
    (void)state;
    char msg[300];
    pd_safetensors st;
    const uint8_t five[5] = {1, 2, 3, 4, 5};
    assert_err(pd_safetensors_parse(&st, five, 5, msg, sizeof(msg)), PD_ERR_PARSE);
    assert_non_null(strstr(msg, "shorter than the 8-byte header length"));
    size_t len;
    uint8_t *b = image("{}", 1000, 40, &len);
    assert_err(pd_safetensors_parse(&st, b, len, msg, sizeof(msg)), PD_ERR_PARSE);
    assert_non_null(strstr(msg, "header length 1000 runs past the end of the file"));
    free(b);
    b = image("{}", UINT64_C(1) << 40, 40, &len);
    assert_err(pd_safetensors_parse(&st, b, len, msg, sizeof(msg)), PD_ERR_PARSE);
    assert_non_null(strstr(msg, "exceeds the limit"));
    free(b);
    /* the valid minimum: an empty header and no data */
    b = image("{}", 2, 0, &len);
    assert_ok(pd_safetensors_parse(&st, b, len, msg, sizeof(msg)));
    assert_int_equal(st.n_tensors, 0);
    pd_safetensors_close(&st);
    free(b);
}

/* ---- sharded checkpoints ------------------------------------------------------------- */

static void expect_load_error(const char *dir, const char *message);

static void write_text(const char *dir, const char *file, const char *text) {
    char p[256];
    snprintf(p, sizeof(p), "%s/%s", dir, file);
    FILE *f = fopen(p, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

/* The index with one tensor's entry replaced by value (a JSON text). */
static void edit_index(const char *dir, const char *tensor, const char *value) {
    char p[256], msg[200];
    snprintf(p, sizeof(p), "%s/model.safetensors.index.json", dir);
    json_error_t jerr;
    json_t *root = json_load_file(p, 0, &jerr);
    assert_non_null(root);
    json_t *map = json_object_get(root, "weight_map");
    if (value) json_object_set_new(map, tensor, json_loads(value, JSON_DECODE_ANY, &jerr));
    else json_object_del(map, tensor);
    char *text = json_dumps(root, 0);
    snprintf(msg, sizeof msg, "%s", "");
    write_text(dir, "model.safetensors.index.json", text);
    free(text);
    json_decref(root);
}

static void sharded_checkpoints_load_and_are_checked(void **state) {
    (void)state;
    pd_model *m = tiny_model("MAMA", 33);
    char dir[128], msg[300];
    dir_path(dir, sizeof(dir), "sharded");
    if (pd_model_save_sharded(m, dir, PD_DTYPE_BF16, 3, msg, sizeof(msg)) != PD_OK)
        fail_msg("save: %s", msg);
    pd_model *back = NULL;
    if (pd_model_load(&back, dir, msg, sizeof(msg)) != PD_OK) fail_msg("load: %s", msg);
    /* the same weights as the single-file bf16 checkpoint */
    char one[128];
    save(m, "sharded_one", PD_DTYPE_BF16, one, sizeof(one));
    pd_model *single = NULL;
    if (pd_model_load(&single, one, msg, sizeof(msg)) != PD_OK) fail_msg("load: %s", msg);
    for (uint32_t i = 0; i < pd_model_tensor_count(m); i++) {
        const char *name = pd_model_tensor_name(m, i);
        uint64_t n = pd_model_tensor_values(back, name, NULL, 0);
        float *a = malloc(n * sizeof(float)), *b = malloc(n * sizeof(float));
        pd_model_tensor_values(back, name, a, n);
        pd_model_tensor_values(single, name, b, n);
        assert_memory_equal(a, b, n * sizeof(float));
        free(b);
        free(a);
    }
    pd_model_destroy(single);
    pd_model_destroy(back);
    rm_model_dir(one);
    const char *first = "model.embed_tokens.weight";
    /* a tensor the index puts in another shard than the one holding it */
    edit_index(dir, first, "\"model-00002-of-00003.safetensors\"");
    expect_load_error(dir, "tensor 'model.embed_tokens.weight' is missing");
    /* a shard outside the directory, a missing shard */
    edit_index(dir, first, "\"../model-00001-of-00003.safetensors\"");
    expect_load_error(dir, "not a .safetensors file in the directory");
    edit_index(dir, first, "\"model-00009-of-00009.safetensors\"");
    expect_load_error(dir, "model-00009-of-00009.safetensors");
    /* a tensor the index does not list */
    edit_index(dir, first, NULL);
    expect_load_error(dir,
                      "model.safetensors.index.json: tensor 'model.embed_tokens.weight' is "
                      "missing");
    write_text(dir, "model.safetensors.index.json", "{\"weight_map\": []}");
    expect_load_error(dir, "'weight_map' must be a non-empty object");
    write_text(dir, "model.safetensors.index.json", "{\"weight_map\": {\"a\": 1}");
    expect_load_error(dir, "not valid JSON");
    pd_model_destroy(m);
    rm_model_dir(dir);
}

/* ---- malformed model directories ------------------------------------------------------- */

static void expect_load_error(const char *dir, const char *message) {
    pd_model *m = (pd_model *)1;
    char msg[400] = "";
    pd_err err = pd_model_load(&m, dir, msg, sizeof(msg));
    if (err == PD_OK) fail_msg("'%s' expected but the model loaded", message);
    assert_null(m);
    if (!strstr(msg, message)) fail_msg("'%s' lacks '%s'", msg, message);
}

/* Rewrites the JSON header of dir/model.safetensors with edit(), keeping
 * the data. */
static void edit_header(const char *dir, void (*edit)(json_t *root)) {
    char path[256];
    file_path(path, sizeof(path), dir, "model.safetensors");
    size_t len;
    uint8_t *b = read_all(path, &len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | b[i];
    json_t *root = json_loadb((const char *)b + 8, hlen, 0, NULL);
    assert_non_null(root);
    edit(root);
    char *h = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    size_t nh = strlen(h), data = len - 8 - hlen;
    uint8_t *out = malloc(8 + nh + data);
    for (int i = 0; i < 8; i++) out[i] = (uint8_t)((uint64_t)nh >> (8 * i));
    memcpy(out + 8, h, nh);
    memcpy(out + 8 + nh, b + 8 + hlen, data);
    write_all(path, out, 8 + nh + data);
    free(out);
    free(h);
    json_decref(root);
    free(b);
}

static void to_i32(json_t *root) {
    json_object_set_new(json_object_get(root, "model.norm.weight"), "dtype", json_string("I32"));
}

static void reshape(json_t *root) {
    /* model.norm.weight is [64]; [8, 8] has the same bytes but not the shape */
    json_object_set_new(json_object_get(root, "model.norm.weight"), "shape",
                        json_pack("[i,i]", 8, 8));
}

static void edit_config(const char *dir, const char *key, json_t *value) {
    char path[256];
    file_path(path, sizeof(path), dir, "config.json");
    json_t *root = json_load_file(path, 0, NULL);
    assert_non_null(root);
    if (value) json_object_set_new(root, key, value);
    else json_object_del(root, key);
    assert_int_equal(json_dump_file(root, path, 0), 0);
    json_decref(root);
}

/* Writes the model's tensors to dir/model.safetensors, leaving out `skip`
 * and adding `extra`. */
static void write_tensors(const pd_model *m, const char *dir, const char *skip, const char *extra) {
    pd_st_input in[PD_MODEL_TENSORS_MAX + 1];
    uint32_t n = 0;
    for (uint32_t i = 0; i < m->n_tensors; i++) {
        const pd_tensor_entry *e = &m->tensors[i];
        if (skip && !strcmp(e->name, skip)) continue;
        in[n] = (pd_st_input){.name = e->name, .ndim = e->ndim, .data = m->data + e->offset};
        memcpy(in[n].shape, e->shape, sizeof(e->shape));
        n++;
    }
    float four[4] = {1, 2, 3, 4};
    if (extra) in[n++] = (pd_st_input){.name = extra, .ndim = 1, .shape = {4}, .data = four};
    char path[256], msg[300];
    file_path(path, sizeof(path), dir, "model.safetensors");
    if (pd_safetensors_write(path, in, n, PD_DTYPE_F32, msg, sizeof(msg)) != PD_OK)
        fail_msg("%s", msg);
}

/* Saves m afresh into the "bad" directory (its path into dir), to be broken one way. */
static void fresh(const pd_model *m, char *dir, size_t cap) {
    save(m, "bad", PD_DTYPE_F32, dir, cap);
}

static void broken_configs_are_refused(const pd_model *m, char *dir, size_t cap) {
    char path[256];
    fresh(m, dir, cap);
    file_path(path, sizeof(path), dir, "config.json");
    write_all(path, "{\"vocab_size\": 258,", 19);
    expect_load_error(dir, "config.json: not valid JSON");

    fresh(m, dir, cap);
    edit_config(dir, "hidden_size", NULL);
    expect_load_error(dir, "missing 'hidden_size'");

    fresh(m, dir, cap);
    edit_config(dir, "num_key_value_heads", json_integer(3));
    expect_load_error(dir, "not a multiple of attn_kv_heads");

    fresh(m, dir, cap);
    edit_config(dir, "model_type", json_string("llama"));
    expect_load_error(dir, "model_type must be");

    fresh(m, dir, cap);
    edit_config(dir, "hidden_size", json_string("64"));
    expect_load_error(dir, "'hidden_size' must be an integer");
}

static void broken_tensor_files_are_refused(const pd_model *m, char *dir, size_t cap) {
    char path[256];
    fresh(m, dir, cap);
    file_path(path, sizeof(path), dir, "model.safetensors");
    unlink(path);
    expect_load_error(dir, "model.safetensors: No such file");

    fresh(m, dir, cap);
    write_tensors(m, dir, "model.norm.weight", NULL);
    expect_load_error(dir, "tensor 'model.norm.weight' is missing");

    fresh(m, dir, cap);
    write_tensors(m, dir, NULL, "extra.weight");
    expect_load_error(dir, "tensor 'extra.weight' is not part of this model");

    fresh(m, dir, cap);
    edit_header(dir, to_i32);
    expect_load_error(dir, "tensor 'model.norm.weight': dtype I32 not accepted (F32, F16 or BF16)");

    fresh(m, dir, cap);
    edit_header(dir, reshape);
    expect_load_error(dir, "tensor 'model.norm.weight': shape [8, 8] but the config needs [64]");
}

static void malformed_model_directories_are_refused_with_their_message(void **state) {
    (void)state;
    pd_model *m = tiny_model("MA", 33);
    char dir[128], path[256], msg[300];
    dir_path(dir, sizeof(dir), "bad");

    expect_load_error(dir, "config.json: cannot open");
    broken_configs_are_refused(m, dir, sizeof(dir));
    broken_tensor_files_are_refused(m, dir, sizeof(dir));

    /* a NaN inside the last tensor's data */
    fresh(m, dir, sizeof(dir));
    file_path(path, sizeof(path), dir, "model.safetensors");
    size_t len;
    uint8_t *b = read_all(path, &len);
    const uint8_t nan_le[4] = {0x00, 0x00, 0xc0, 0x7f};
    memcpy(b + len - 8, nan_le, 4);
    write_all(path, b, len);
    expect_load_error(dir, "is not finite");

    /* a truncated file: the last tensor now runs past the data */
    write_all(path, b, len - 100);
    expect_load_error(dir, "past the data buffer");
    free(b);

    /* and the untouched directory loads */
    fresh(m, dir, sizeof(dir));
    pd_model *ok = NULL;
    if (pd_model_load(&ok, dir, msg, sizeof(msg)) != PD_OK) fail_msg("%s", msg);
    pd_model_destroy(ok);
    rm_model_dir(dir);
    pd_model_destroy(m);
}

/* ---- never crash ------------------------------------------------------------------------ */

/* Random corruptions of a small valid file (header bytes, the length field,
 * truncation, data bytes): the reader returns an error with a message or a
 * consistent index, and never reads outside the buffer. */
static void random_corruptions_never_crash_the_reader(void **state) {
    (void)state;
    char path[256], msg[300];
    snprintf(path, sizeof(path), "%s/fuzz.safetensors", tmp_root);
    float v[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    pd_st_input in[3] = {{.name = "w", .ndim = 2, .shape = {3, 2}, .data = v},
                         {.name = "b", .ndim = 1, .shape = {5}, .data = v + 6},
                         {.name = "e", .ndim = 2, .shape = {0, 4}, .data = v}};
    assert_ok(pd_safetensors_write(path, in, 3, PD_DTYPE_BF16, msg, sizeof(msg)));
    size_t len;
    uint8_t *orig = read_all(path, &len);
    unlink(path);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | orig[i];
    pd_rng rng;
    pd_rng_seed(&rng, test_seed(4242));
    uint8_t *b = malloc(len + 16);
    uint32_t accepted = 0;
    const char *noise = "{}[],:\"0123456789-.eE \\u";
    for (int iter = 0; iter < 4000; iter++) {
        memcpy(b, orig, len);
        size_t n = len;
        int edits = 1 + (int)pd_rng_below(&rng, 3);
        for (int e = 0; e < edits; e++) {
            switch (pd_rng_below(&rng, 5)) {
            case 0: b[8 + pd_rng_below(&rng, hlen)] = (uint8_t)pd_rng_below(&rng, 256); break;
            case 1:
                b[8 + pd_rng_below(&rng, hlen)] = (uint8_t)noise[pd_rng_below(&rng, strlen(noise))];
                break;
            case 2: b[pd_rng_below(&rng, 8)] ^= (uint8_t)(1u << pd_rng_below(&rng, 8)); break;
            case 3: n = (size_t)pd_rng_below(&rng, n + 1); break;
            default: b[pd_rng_below(&rng, n ? n : 1)] ^= 0xff; break;
            }
        }
        /* parse from an exactly-sized copy so ASan sees any overread */
        uint8_t *exact = malloc(n ? n : 1);
        memcpy(exact, b, n);
        pd_safetensors st;
        msg[0] = '\0';
        pd_err err = pd_safetensors_parse(&st, exact, n, msg, sizeof(msg));
        if (err == PD_OK) {
            accepted++;
            for (uint32_t t = 0; t < st.n_tensors; t++) {
                const pd_st_tensor *ts = &st.tensors[t];
                assert_true(ts->begin <= ts->end && ts->end <= st.data_bytes);
                if (ts->dtype == PD_DTYPE_F32 || ts->dtype == PD_DTYPE_F16 ||
                    ts->dtype == PD_DTYPE_BF16) {
                    float *out = malloc(sizeof(float) * (ts->elems ? ts->elems : 1));
                    assert_ok(pd_safetensors_read_f32(&st, ts, out, ts->elems, msg, sizeof(msg)));
                    free(out);
                }
            }
        } else {
            assert_true(strlen(msg) > 0);
        }
        pd_safetensors_close(&st);
        free(exact);
    }
    assert_true(accepted > 0); /* some edits (data bytes) leave the file valid */
    free(b);
    free(orig);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(f32_round_trip_gives_identical_weights_and_tokens),
        cmocka_unit_test(half_precision_files_load_rounded_weights),
        cmocka_unit_test(sharded_checkpoints_load_and_are_checked),
        cmocka_unit_test(malformed_headers_are_refused_with_their_message),
        cmocka_unit_test(bad_framing_is_refused_with_its_message),
        cmocka_unit_test(malformed_model_directories_are_refused_with_their_message),
        cmocka_unit_test(random_corruptions_never_crash_the_reader),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
