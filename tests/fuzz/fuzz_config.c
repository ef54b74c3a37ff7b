/* A model directory's config.json from the outside world: parsed and
 * checked, and for one that passes, the sizes derived from it (which must
 * not overflow into nonsense: every figure at least the part it sums). */
#include "fuzz.h"
#include "pdserve/model.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    pd_model_config cfg;
    char msg[256];
    if (pd_model_config_parse(&cfg, (const char *)data, size, "config.json", msg, sizeof(msg)) !=
        PD_OK)
        return 0;
    pd_model_shape sh;
    pd_model_config_shape(&cfg, &sh);
    size_t page = pd_model_kv_page_bytes(&cfg, 16);
    PD_ASSERT(page >= pd_model_kv_page_bytes(&cfg, 1));
    return 0;
}
