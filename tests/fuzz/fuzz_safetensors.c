/* A safetensors file from the outside world: the header parser and the
 * conversion of every floating-point tensor small enough to convert. */
#include <stdlib.h>

#include "fuzz.h"
#include "pdserve/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    pd_safetensors st;
    char msg[256];
    if (pd_safetensors_parse(&st, data, size, msg, sizeof(msg)) != PD_OK) return 0;
    for (uint32_t i = 0; i < st.n_tensors; i++) {
        const pd_st_tensor *t = &st.tensors[i];
        PD_ASSERT(t->begin <= t->end && t->end <= st.data_bytes);
        PD_ASSERT(pd_safetensors_find(&st, t->name) != NULL);
        if (t->elems > (1u << 16)) continue;
        float *out = malloc((size_t)(t->elems ? t->elems : 1) * sizeof(float));
        if (out) pd_safetensors_read_f32(&st, t, out, t->elems, msg, sizeof(msg));
        free(out);
    }
    pd_safetensors_close(&st);
    return 0;
}
