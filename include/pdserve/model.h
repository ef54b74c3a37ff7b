/*
 * pd_model — the tiny hybrid attention + Mamba2 model: a real forward pass on
 * the CPU over the node's paged memory, behind the engines' executor
 * interface (include/pdserve/executor.h). docs/model.md has the equations,
 * the shapes and the bytes a prefill node hands to a decode node.
 *
 * Three objects:
 *   pd_model_config  what the model is: vocabulary, width, a layer pattern
 *                    such as "MAMA" (M = Mamba2 mixer, A = grouped-query
 *                    attention), head counts, Mamba2 sizes, MLP width.
 *   pd_model         immutable fp32 weights: seeded dummy weights, or a model
 *                    directory (config.json + model.safetensors). Shared by
 *                    any number of executors; it must outlive them.
 *   executor         the node's memory (KV pages, Mamba state slots, host
 *                    pages), scratch sized at creation, a thread pool, and
 *                    the vtable the engines drive. launch() computes the
 *                    batch synchronously; poll() hands back stored results.
 *
 * Bit-exactness. The output of a position depends only on the tokens before
 * it, never on how they were chunked, batched, paged, threaded or which node
 * computed them: every reduction runs in one fixed order, the Mamba scan is
 * token-sequential, threads split only output rows or heads, the build uses
 * -ffp-contract=off without fast-math, greedy sampling takes the first of
 * equal maxima, and exp/log/sin/cos are our own routines rather than libm's
 * (whose CPU-specific variants may differ in the last bit): IEEE arithmetic
 * is all two machines need to agree.
 *
 * Memory layout (what a transport moves):
 *   KV page p   at kv + p * kv_page_bytes: for each attention layer a (in
 *               pattern order) K then V, each [page_size][kv_heads][head_dim]
 *               fp32.
 *   Mamba slot s at mamba + s * mamba_slot_bytes: for each Mamba layer m (in
 *               pattern order) conv state [conv_dim][d_conv - 1] (the last
 *               d_conv - 1 raw inputs, oldest first) then ssm state
 *               [heads][head_dim][d_state], all fp32.
 *   Host page h is a byte copy of a KV page.
 *
 * Executor contract details this implementation adds:
 *   - an item with start_pos == 0 starts from the zero Mamba state: the
 *     running slot's previous contents are ignored (a fresh slot from the pool
 *     need not be cleared); with start_pos > 0 the slot must hold the state
 *     after position start_pos - 1 (its own, a snapshot copy, or a transfer).
 *   - a batch holds at most PD_MODEL_BATCH_ITEMS_MAX items, each with at
 *     least one token; at most PD_MODEL_INFLIGHT_MAX batches wait for poll.
 *   - the reported logprob is the model's log-softmax of the chosen token,
 *     before temperature and top-p.
 */
#ifndef PDSERVE_MODEL_H
#define PDSERVE_MODEL_H

#include "pdserve/base.h"
#include "pdserve/executor.h"
#include "pdserve/safetensors.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_MODEL_LAYERS_MAX 64
#define PD_MODEL_BATCH_ITEMS_MAX 512u
#define PD_MODEL_INFLIGHT_MAX 8u
#define PD_MODEL_THREADS_MAX 64u
#define PD_MODEL_PAGE_SIZE_MAX 4096u
/* model.safetensors files larger than this are refused (16 GiB). */
#define PD_MODEL_FILE_BYTES_MAX (UINT64_C(16) << 30)

/* The checkpoint family: which config.json and tensor names, and the few
 * places the forward pass differs (docs/model.md). */
typedef enum pd_model_arch {
    PD_ARCH_HYBRID = 0, /* pdserve's own hybrid ("pdserve_hybrid"; M and A layers) */
    PD_ARCH_LLAMA,      /* LlamaForCausalLM: attention layers only */
    PD_ARCH_QWEN3,      /* Qwen3ForCausalLM: Llama + RMSNorm of each q and k head */
    PD_ARCH_GRANITE,    /* GraniteMoeHybridForCausalLM without experts (granite-4.0-h):
                         * M and A layers, muP multipliers, gated norm over all of d_inner */
} pd_model_arch;

typedef struct pd_model_config {
    pd_model_arch arch;
    uint32_t vocab;
    uint32_t dim;                       /* model (residual stream) width */
    char layers[PD_MODEL_LAYERS_MAX + 1]; /* 'M' and 'A', one per layer */
    uint32_t attn_heads;
    uint32_t attn_kv_heads;
    uint32_t attn_head_dim;             /* even (RoPE rotates halves) */
    uint32_t mamba_d_state;
    uint32_t mamba_d_conv;
    uint32_t mamba_expand;              /* d_inner = expand * dim */
    uint32_t mamba_heads;               /* divides d_inner */
    uint32_t mamba_groups;              /* B/C groups; divides mamba_heads */
    uint32_t mlp_hidden;
    float norm_eps;
    float rope_base;
    /* rope_scaling of type "llama3" (Llama 3.1+); rope_factor 0: none. */
    float rope_factor;
    float rope_low_freq_factor, rope_high_freq_factor;
    uint32_t rope_original_max; /* original_max_position_embeddings */
    bool tie_embeddings;        /* lm_head shares embed_tokens */
    bool no_rope;               /* attention without positions (Granite's "nope") */
    /* Granite's multipliers; 0 means the plain model (1, 1, 1 and 1/sqrt(head_dim)):
     * x0 = embedding * embed_mult, x += sublayer(x) * residual_mult,
     * logits = head(x) / logits_div, attention scores = q.k * attn_scale. */
    float embed_mult, residual_mult, logits_div, attn_scale;
    int32_t bos_token; /* -1: none */
    int32_t eos_token; /* -1: none */
} pd_model_config;

/* "pdserve_hybrid", or the Hugging Face architecture name
 * ("LlamaForCausalLM", "Qwen3ForCausalLM", "GraniteMoeHybridForCausalLM"). */
const char *pd_model_arch_name(pd_model_arch arch);

/* Sizes derived from a valid config. */
typedef struct pd_model_shape {
    uint32_t n_layers, n_attn, n_mamba;
    uint32_t q_dim, kv_dim;             /* heads * head_dim, kv_heads * head_dim */
    uint32_t mamba_d_inner, mamba_head_dim, mamba_conv_dim, mamba_in_proj;
    size_t kv_bytes_per_token;          /* K and V of every attention layer */
    size_t mamba_conv_bytes_per_layer;
    size_t mamba_ssm_bytes_per_layer;
    size_t mamba_slot_bytes;            /* every Mamba layer */
    uint64_t params;
    /* 2 * multiply-adds per token in the weight matrices (projections, MLP,
     * lm_head); attention over the context adds 4 * q_dim * context per
     * attention layer. */
    uint64_t matmul_flops_per_token;
} pd_model_shape;

/* "tiny" (fast on one core; the default) or "small" (for benchmarks), both
 * hybrid; "llama" and "qwen3": tiny checkpoints of those families. */
pd_err pd_model_config_preset(pd_model_config *out, const char *name, char *msg, size_t msg_cap);
/* Every field in range and consistent; the message names the first problem. */
pd_err pd_model_config_check(const pd_model_config *cfg, char *msg, size_t msg_cap);
/* A config.json's text into *cfg, checked as pd_model_config_check does;
 * path only names the source in messages. */
pd_err pd_model_config_parse(pd_model_config *cfg, const char *json, size_t len, const char *path,
                             char *msg, size_t msg_cap);
/* cfg must pass pd_model_config_check. */
void pd_model_config_shape(const pd_model_config *cfg, pd_model_shape *out);
/* Bytes of one KV page for this model. */
size_t pd_model_kv_page_bytes(const pd_model_config *cfg, uint32_t page_size);

/* ---- weights ------------------------------------------------------------- */

typedef struct pd_model pd_model;

/* Dummy weights from a seed, initialised like Mamba2 and attention layers
 * usually are (see docs/model.md), so activations stay in range. */
pd_err pd_model_create_random(pd_model **out, const pd_model_config *cfg, uint64_t seed,
                              char *msg, size_t msg_cap);
/* Reads dir/config.json and dir/model.safetensors, or the shards that
 * dir/model.safetensors.index.json maps each tensor to (F32, F16 or BF16);
 * checks every tensor's presence, shape, dtype and finiteness, and that each
 * shard holds exactly what the index says. */
pd_err pd_model_load(pd_model **out, const char *dir, char *msg, size_t msg_cap);
/* Writes dir/config.json and dir/model.safetensors (creates dir if needed). */
pd_err pd_model_save(const pd_model *m, const char *dir, pd_dtype dtype, char *msg,
                     size_t msg_cap);
/* The same in `shards` files (model-0000K-of-0000N.safetensors, tensors in
 * table order) with model.safetensors.index.json, as Hugging Face shards a
 * checkpoint; shards = 1 is pd_model_save. pd_model_load reads either. */
pd_err pd_model_save_sharded(const pd_model *m, const char *dir, pd_dtype dtype, uint32_t shards,
                             char *msg, size_t msg_cap);
void pd_model_destroy(pd_model *m);

const pd_model_config *pd_model_config_get(const pd_model *m);
const pd_model_shape *pd_model_shape_get(const pd_model *m);
/* The fp32 values of a named tensor and their count; NULL if no such tensor
 * or if it is kept as bf16 (the matrices of a BF16 checkpoint are:
 * pd_model_tensor_values widens them). */
const float *pd_model_tensor(const pd_model *m, const char *name, uint64_t *n_out);
/* Copies up to cap of the tensor's values as fp32 (bf16 widened exactly)
 * and returns its element count; 0 if no such tensor. */
uint64_t pd_model_tensor_values(const pd_model *m, const char *name, float *out, uint64_t cap);
/* True when the tensor is kept in memory as bf16. */
bool pd_model_tensor_is_bf16(const pd_model *m, const char *name);
uint32_t pd_model_tensor_count(const pd_model *m);
const char *pd_model_tensor_name(const pd_model *m, uint32_t i);

/* ---- the executor -------------------------------------------------------- */

/* Creates an executor over fresh, zeroed memory: kv_pages KV pages of
 * page_size tokens, mamba_slots state slots (0 for a model without Mamba
 * layers is fine), host_pages host pages, and threads workers in all
 * (1 = the calling thread only). */
pd_err pd_model_executor_create(pd_executor *out, const pd_model *model, uint32_t page_size,
                                uint32_t kv_pages, uint32_t mamba_slots, uint32_t host_pages,
                                uint32_t threads, char *msg, size_t msg_cap);
/* The same, with the KV pages and Mamba slots from alloc (a transport's,
 * executor.h; NULL: the heap). alloc must outlive the executor. */
pd_err pd_model_executor_create_in(pd_executor *out, const pd_model *model, uint32_t page_size,
                                   uint32_t kv_pages, uint32_t mamba_slots, uint32_t host_pages,
                                   uint32_t threads, const pd_exec_alloc *alloc, char *msg,
                                   size_t msg_cap);
void pd_model_executor_destroy(pd_executor *ex);
/* True when ex was made by pd_model_executor_create. */
bool pd_model_executor_is(const pd_executor *ex);

/* Runs items now, on the calling thread (plus the pool's workers), exactly as
 * launch would. results[i] for item i, and tops[i] for an item that asks for
 * top logprobs (tops may be NULL when none does); logits, when not NULL, receives
 * vocab floats per item at logits + i * vocab for the items that sample
 * (the distribution after the item's last token). PD_ERR_INVALID with a
 * message, and nothing computed, when an item breaks the contract. */
pd_err pd_model_forward(pd_executor *ex, const pd_batch_item *items, uint32_t n_items,
                        pd_item_result *results, pd_item_top *tops, float *logits, char *msg,
                        size_t msg_cap);

/* Work below this many FLOPs runs on the calling thread alone (default
 * 200,000: a dispatch to the workers costs microseconds). 0 splits every
 * step, which tests use to exercise the threads on tiny models. */
void pd_model_executor_set_min_parallel_flops(pd_executor *ex, uint64_t flops);

/* Cumulative FLOPs done by this executor (matmuls and attention), for
 * benchmarks. */
uint64_t pd_model_executor_flops(const pd_executor *ex);

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_MODEL_H */
