/*
 * pd_chat_template — Hugging Face chat templates (a Jinja subset) in C.
 *
 * A model's tokenizer_config.json carries a `chat_template`: a Jinja program
 * that turns a conversation into the prompt the model was trained on. This
 * module compiles such a template once (lexer, recursive-descent parser to an
 * AST) and renders it for each request with a JSON context (messages,
 * add_generation_prompt, bos_token, eos_token, tools, enable_thinking...).
 *
 * The reference is @huggingface/jinja, the renderer transformers.js uses: the
 * same preprocessing (lstrip_blocks, trim_blocks, one trailing newline
 * dropped), the same Undefined (an unknown name or attribute renders as ""
 * and is falsy), the same printing of values (true, not True; none prints as
 * ""). tests/template renders the real templates of Qwen3, Qwen2.5, Llama 3
 * and Llama 3.1 with both and compares the bytes. docs/model.md lists the subset;
 * anything outside it is refused when the template is compiled, with the line
 * and column and the construct named, never silently mis-rendered.
 *
 * Invariants: a compiled template is immutable, so one may be rendered from
 * many threads at once; every render allocates from its own arena, bounded by
 * PD_CHAT_TEMPLATE_MEMORY_MAX, and frees it before returning.
 */
#ifndef PDSERVE_CHAT_TEMPLATE_H
#define PDSERVE_CHAT_TEMPLATE_H

#include <jansson.h>

#include "pdserve/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Limits: a template's source, the depth of its syntax tree (blocks and
 * expressions nested, each link of a chain such as a + b + c or x|f|g
 * counting as a level), and the memory one render may use (its values and
 * its output together). */
#define PD_CHAT_TEMPLATE_SOURCE_MAX (1u << 20)
#define PD_CHAT_TEMPLATE_DEPTH_MAX 128u
#define PD_CHAT_TEMPLATE_MEMORY_MAX ((size_t)256 << 20)

typedef struct pd_chat_template pd_chat_template;

/* Compiles src[0..len). On failure returns PD_ERR_PARSE (or PD_ERR_TOOBIG,
 * PD_ERR_NOMEM) with "chat template line L col C: ..." in msg, naming the
 * construct that is not supported where that is the reason. */
pd_err pd_chat_template_compile(const char *src, size_t len, pd_chat_template **out, char *msg,
                                size_t msg_cap);

/* Renders with the variables of the JSON object ctx into a malloc'd,
 * NUL-terminated *out (*out_len bytes without the NUL; the caller frees it).
 * raise_exception('text') in the template returns PD_ERR_INVALID with msg
 * exactly "text"; other failures (a type error, the memory limit) return
 * PD_ERR_INVALID or PD_ERR_TOOBIG with "chat template line L: ..." in msg. */
pd_err pd_chat_template_render(const pd_chat_template *t, const json_t *ctx, char **out,
                               size_t *out_len, char *msg, size_t msg_cap);

void pd_chat_template_free(pd_chat_template *t);

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_CHAT_TEMPLATE_H */
