/*
 * pd_safetensors — a strict reader and a writer of the safetensors format.
 *
 * The format: 8 bytes little-endian u64 N, then N bytes of JSON header, then
 * the data buffer. The header maps tensor names to {"dtype", "shape",
 * "data_offsets": [begin, end]} (offsets relative to the data buffer) and may
 * hold one "__metadata__" object of string values.
 *
 * A model file is input from outside the process, so the reader trusts
 * nothing: the header length is bounded and must fit in the file, the JSON
 * must be well formed (duplicate keys refused), every entry must have exactly
 * the three fields with the right types, the byte range of every tensor must
 * equal its element count times its dtype size, lie inside the data buffer,
 * and the tensors sorted by offset must tile the buffer exactly: no gap, no
 * overlap, nothing after the last one. Every refusal names the tensor (when
 * there is one) and the problem. No input makes it crash or read out of
 * bounds; the test suite feeds it thousands of mutated files under ASan.
 *
 * The reader either borrows a caller's buffer (pd_safetensors_parse) or owns
 * a copy of a whole file (pd_safetensors_open). Conversion to fp32 accepts
 * F32, F16 and BF16; the writer emits any of those three from fp32 input,
 * rounding to nearest even.
 */
#ifndef PDSERVE_SAFETENSORS_H
#define PDSERVE_SAFETENSORS_H

#include "pdserve/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum pd_dtype {
    PD_DTYPE_BOOL = 0,
    PD_DTYPE_U8,
    PD_DTYPE_I8,
    PD_DTYPE_F8_E4M3,
    PD_DTYPE_F8_E5M2,
    PD_DTYPE_I16,
    PD_DTYPE_U16,
    PD_DTYPE_F16,
    PD_DTYPE_BF16,
    PD_DTYPE_I32,
    PD_DTYPE_U32,
    PD_DTYPE_F32,
    PD_DTYPE_F64,
    PD_DTYPE_I64,
    PD_DTYPE_U64,
    PD_DTYPE__COUNT
} pd_dtype;

/* The format's spelling ("F32", "BF16", ...). */
const char *pd_dtype_name(pd_dtype dtype);
size_t pd_dtype_bytes(pd_dtype dtype);
/* false for an unknown name. */
bool pd_dtype_parse(const char *name, pd_dtype *out);

#define PD_ST_HEADER_BYTES_MAX (UINT64_C(100) << 20) /* as the reference reader */
#define PD_ST_NAME_BYTES_MAX 256                      /* including the NUL */
#define PD_ST_NDIM_MAX 8
#define PD_ST_TENSORS_MAX 100000u

typedef struct pd_st_tensor {
    char name[PD_ST_NAME_BYTES_MAX];
    pd_dtype dtype;
    uint32_t ndim;
    uint64_t shape[PD_ST_NDIM_MAX];
    uint64_t elems;            /* product of shape (1 for a scalar) */
    uint64_t begin, end;       /* byte range inside the data buffer */
} pd_st_tensor;

typedef struct pd_safetensors {
    void *mapped; /* the file's mapping when opened from a path */
    size_t mapped_bytes;
    const uint8_t *data;       /* start of the data buffer */
    uint64_t data_bytes;
    pd_st_tensor *tensors;     /* in header order */
    uint32_t n_tensors;
} pd_safetensors;

/* Validates bytes[0..size) and indexes its tensors. The buffer is borrowed:
 * it must outlive st. On error st is left empty (safe to close). */
pd_err pd_safetensors_parse(pd_safetensors *st, const uint8_t *bytes, size_t size,
                            char *msg, size_t msg_cap);

/* Maps a file (at most file_bytes_max bytes, read-only) and parses it. */
pd_err pd_safetensors_open(pd_safetensors *st, const char *path, uint64_t file_bytes_max,
                           char *msg, size_t msg_cap);

void pd_safetensors_close(pd_safetensors *st);

/* NULL when absent. */
const pd_st_tensor *pd_safetensors_find(const pd_safetensors *st, const char *name);

/* Converts a F32, F16 or BF16 tensor to fp32; n must equal t->elems.
 * PD_ERR_INVALID (with a message naming the tensor) for other dtypes. */
pd_err pd_safetensors_read_f32(const pd_safetensors *st, const pd_st_tensor *t,
                               float *out, uint64_t n, char *msg, size_t msg_cap);

/* One tensor to write: fp32 values, converted to the file's dtype. */
typedef struct pd_st_input {
    const char *name;
    uint32_t ndim;
    uint64_t shape[PD_ST_NDIM_MAX];
    const float *data;         /* product(shape) values */
} pd_st_input;

/* Writes tensors in the given order (data laid out in that order, header
 * padded with spaces to a multiple of 8 bytes). dtype: F32, F16 or BF16. */
pd_err pd_safetensors_write(const char *path, const pd_st_input *tensors, uint32_t n,
                            pd_dtype dtype, char *msg, size_t msg_cap);

/* Scalar conversions used by the reader and writer (exposed for tests). */
float pd_f16_to_f32(uint16_t h);
float pd_bf16_to_f32(uint16_t b);
uint16_t pd_f32_to_f16(float f);   /* round to nearest even, overflow to inf */
uint16_t pd_f32_to_bf16(float f);  /* round to nearest even, NaN stays NaN */

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_SAFETENSORS_H */
