/*
 * pd_hf_tokenizer — a Hugging Face `tokenizer.json` byte-level BPE tokenizer,
 * the kind Qwen2/Qwen3 and Llama-3 ship (docs/model.md, "Tokenizer").
 *
 * Encoding runs the same stages as the reference implementations:
 *
 *   1. added tokens ("<|im_start|>", ...) are split out of the raw text first,
 *      leftmost-longest, honouring lstrip/rstrip/single_word;
 *   2. each remaining piece is normalized (none, or NFC through utf8proc);
 *   3. the pre-tokenizer's Split regex (PCRE2, Unicode properties) cuts it into
 *      pre-tokens, each mapped byte by byte through GPT-2's byte-to-unicode
 *      alphabet;
 *   4. BPE merges each pre-token's symbols, lowest merge rank first (leftmost
 *      on ties), unless ignore_merges is set and the whole pre-token is a
 *      vocabulary entry.
 *
 * Input need not be valid UTF-8. A byte that is not part of a valid sequence
 * becomes a pre-token of its own and encodes to its single-byte token, so
 * decode(encode(x)) == x for every byte string x (the reference tokenizers
 * take strings and never see such bytes).
 *
 * Anything this does not implement — a Unigram/WordPiece model, a normalizer
 * other than NFC, another pre-tokenizer or decoder, byte_fallback, dropout —
 * is refused at load time with PD_ERR_INVALID and a message naming it, never
 * silently approximated. A loaded tokenizer is immutable: encode and decode
 * may run on many threads at once.
 */
#ifndef PDSERVE_HF_TOKENIZER_H
#define PDSERVE_HF_TOKENIZER_H

#include "pdserve/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_hf_tokenizer pd_hf_tokenizer;

/* Loads a tokenizer.json file. On failure *out is NULL and msg says what is
 * wrong: PD_ERR_IO (unreadable), PD_ERR_PARSE (not JSON, or a field of the
 * wrong shape), PD_ERR_INVALID (a valid file using something unsupported). */
pd_err pd_hf_tokenizer_load(const char *path, pd_hf_tokenizer **out, char *msg, size_t msg_cap);
/* The same from a buffer holding the file's bytes. */
pd_err pd_hf_tokenizer_load_buf(const char *json, size_t len, pd_hf_tokenizer **out, char *msg,
                                size_t msg_cap);
/* Reads bos_token / eos_token from a tokenizer_config.json (a string or an
 * {"content": ...} object; null or absent leaves the id at -1). */
pd_err pd_hf_tokenizer_load_config(pd_hf_tokenizer *tok, const char *path, char *msg,
                                   size_t msg_cap);
void pd_hf_tokenizer_free(pd_hf_tokenizer *tok);
/* A checkpoint directory's tokenizer: dir/tokenizer.json with
 * dir/tokenizer_config.json when present. PD_OK and *out NULL when the
 * directory has neither tokenizer.json nor tokenizer.model (the caller
 * falls back to the byte tokenizer); PD_ERR_INVALID, naming what is
 * missing, for a tokenizer.model (SentencePiece) without tokenizer.json,
 * and when the tokenizer has more ids than the model's model_vocab. */
pd_err pd_hf_tokenizer_load_dir(const char *dir, uint32_t model_vocab, pd_hf_tokenizer **out,
                                char *msg, size_t msg_cap);

/* Encodes text[0..len) into a malloc'd array (*ids, *n_ids; the caller
 * frees it; never NULL on success, even for no ids). add_special: apply
 * the post-processor's template (TemplateProcessing's BOS etc.); a
 * ByteLevel post-processor, as in the Qwen3 and Llama-3 files tested,
 * adds nothing. */
pd_err pd_hf_tokenizer_encode(const pd_hf_tokenizer *tok, const char *text, size_t len,
                              bool add_special, int32_t **ids, size_t *n_ids, char *msg,
                              size_t msg_cap);

/* The text as the model sees it: text[0..len) normalized (NFC where the
 * file says so) piece by piece exactly as encode does, added tokens as they
 * decode (without the spaces lstrip/rstrip take), into a malloc'd,
 * NUL-terminated string. decode(encode(x)) == normalize(x) for every x. */
pd_err pd_hf_tokenizer_normalize(const pd_hf_tokenizer *tok, const char *text, size_t len,
                                 char **out, size_t *out_len, char *msg, size_t msg_cap);

/* Decodes ids into a malloc'd, NUL-terminated byte string (*out, *out_len
 * without the NUL). skip_special drops special added tokens. An id outside
 * the vocabulary is PD_ERR_INVALID. The bytes need not be valid UTF-8. */
pd_err pd_hf_tokenizer_decode(const pd_hf_tokenizer *tok, const int32_t *ids, size_t n_ids,
                              bool skip_special, char **out, size_t *out_len, char *msg,
                              size_t msg_cap);

/* Ids: one past the largest id; id of a token string (its tokenizer.json
 * spelling) or -1; the spelling of an id or NULL; whether it is special. */
uint32_t pd_hf_tokenizer_vocab_size(const pd_hf_tokenizer *tok);
int32_t pd_hf_tokenizer_token_id(const pd_hf_tokenizer *tok, const char *token, size_t len);
const char *pd_hf_tokenizer_token(const pd_hf_tokenizer *tok, int32_t id);
bool pd_hf_tokenizer_is_special(const pd_hf_tokenizer *tok, int32_t id);
/* From tokenizer_config.json, or -1. */
int32_t pd_hf_tokenizer_bos(const pd_hf_tokenizer *tok);
int32_t pd_hf_tokenizer_eos(const pd_hf_tokenizer *tok);

/* ---- streaming decode ------------------------------------------------------
 * Tokens arrive one at a time and split characters: an emoji can be four
 * byte tokens. The stream holds back a trailing incomplete UTF-8 sequence
 * (at most 3 bytes) until the token that completes it; bytes that can no
 * longer become valid are released as they are. */
typedef struct pd_hf_stream {
    const pd_hf_tokenizer *tok;
    uint8_t held[4];
    uint32_t n_held;
    bool skip_special;
} pd_hf_stream;

void pd_hf_stream_init(pd_hf_stream *s, const pd_hf_tokenizer *tok, bool skip_special);
/* Appends the bytes now complete to out[0..cap) and returns how many bytes
 * were written (at most 3 + the token's length; a token's bytes never exceed
 * PD_HF_TOKEN_BYTES_MAX). An unknown id writes nothing and returns 0. */
size_t pd_hf_stream_push(pd_hf_stream *s, int32_t id, char *out, size_t cap);
/* Releases whatever is held (at the end of a generation). */
size_t pd_hf_stream_flush(pd_hf_stream *s, char *out, size_t cap);

#define PD_HF_TOKEN_BYTES_MAX 1024u

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_HF_TOKENIZER_H */
