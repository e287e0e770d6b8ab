/*
 * vLLM's tokenizer endpoints, as pure functions (router/api/openai.h's conventions: no sockets,
 * errors as duet_oai_error_t, never logs):
 *
 *   POST /tokenize    {"model"?, "prompt", "add_special_tokens"?}
 *                  or {"model"?, "messages", "add_generation_prompt"?, "tools"?}
 *                     -> {"count": N, "max_model_len": M, "tokens": [ids]}
 *   POST /detokenize  {"model"?, "tokens": [ids]} -> {"prompt": text}
 *
 * A prompt tokenizes exactly as /v1/completions would send it to the model (the bos id when the
 * tokenizer adds one, the template's completion_prefix, then the text; add_special_tokens false:
 * the text alone); messages exactly as /v1/chat/completions would (validated by the same parser,
 * through the chat template; add_generation_prompt, default true, adds the assistant's turn;
 * add_special_tokens is accepted and has no effect on messages: the template places the special
 * tokens). max_model_len is lim->max_context (null when 0: no limit). Detokenize decodes every
 * id, special ones included (transformers' decode without skip_special_tokens); ill-formed
 * UTF-8 becomes U+FFFD. "model", when given and not null, must name the served model (404).
 * Unknown fields follow lim->strict as the completions endpoints do.
 */
#ifndef DUET_ROUTER_TOKENIZE_H
#define DUET_ROUTER_TOKENIZE_H

#include "router/api/openai.h"

/*
 * Answer a /tokenize body of `len` bytes: DUET_OK and the response object appended to out, else
 * DUET_ERR_INVALID (DUET_ERR_RANGE for 413, DUET_ERR_NOMEM for 500) with *err filled.
 */
duet_status_t duet_oai_tokenize(const duet_oai_limits_t *lim, const duet_oai_template_t *tmpl,
                                const duet_tokenizer_t *tok, const char *body, size_t len,
                                duet_strbuf_t *out, duet_oai_error_t *err);

/* Answer a /detokenize body; same conventions as duet_oai_tokenize. */
duet_status_t duet_oai_detokenize(const duet_oai_limits_t *lim, const duet_tokenizer_t *tok,
                                  const char *body, size_t len, duet_strbuf_t *out,
                                  duet_oai_error_t *err);

#endif
