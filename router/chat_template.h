/*
 * Chat templates: how a list of chat messages becomes the prompt's token ids.
 *
 * Two sources: a checkpoint's own Jinja template (`chat_template.jinja`, or the string
 * "chat_template" of `tokenizer_config.json`), rendered by the Jinja subset in router/jinja.h,
 * and duet's own small format, documented in router/CHAT_TEMPLATE.md:
 *
 *   chat_template.json = {
 *     "duet_chat_template": 1,
 *     "prefix":            "<|bos|>",             text before the first message
 *     "message":           "{role}: {content}\n", one message; {role} and {content} are replaced
 *     "system" / "user" / "assistant": "...",     optional per-role replacement for "message"
 *     "generation_prompt": "assistant: ",         text after the last message (the model's turn)
 *     "completion_prefix": "<|bos|>"              text before a /v1/completions text prompt
 *   }
 *
 * `{{` and `}}` stand for literal braces. Every key but "duet_chat_template" is optional.
 *
 * The built-in default (used when a model folder ships no template) is the demo model's:
 *
 *   <|bos|>system: ...\nuser: ...\nassistant: ...\nassistant:
 *
 * i.e. prefix "<|bos|>", message "{role}: {content}\n", generation_prompt "assistant: ",
 * completion_prefix "<|bos|>". Role names are "system", "user", "assistant" (a "developer" message
 * arrives here as system).
 *
 * Trust. Special-token text is recognised only in the template's own literal text (it is trusted:
 * it comes from the model folder). Message content is encoded as ordinary text, so a user who
 * types "<|eos|>" gets the bytes of "<|eos|>", never the special id. Ordinary template text and
 * content are concatenated before encoding (only special tokens cut the string), so a BPE
 * tokenizer sees "user: Hello" exactly as it would in one piece.
 *
 * A compiled template is immutable: any number of threads may apply it at once.
 */
#ifndef DUET_ROUTER_CHAT_TEMPLATE_H
#define DUET_ROUTER_CHAT_TEMPLATE_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "engine/tokenizer/tokenizer.h"

typedef enum {
    DUET_OAI_ROLE_SYSTEM = 0, /* also "developer" */
    DUET_OAI_ROLE_USER,
    DUET_OAI_ROLE_ASSISTANT,
    DUET_OAI_ROLE_COUNT,
} duet_oai_role_t;

/* One chat message, as parsed from a request. */
typedef struct {
    duet_oai_role_t role;
    char *content;      /* owned by the request; NUL-terminated, may hold NULs (use content_len) */
    size_t content_len; /* bytes, valid UTF-8 */
} duet_oai_message_t;

typedef struct duet_oai_template duet_oai_template_t;

/* "system", "user", "assistant". */
const char *duet_oai_role_name(duet_oai_role_t role);

/*
 * Compile a template from the JSON text of a chat_template.json (len bytes; `source` names it in
 * errors), or the built-in default when json is NULL. Literal text is split at the tokenizer's
 * special tokens once, here. Errors: DUET_ERR_FORMAT (bad JSON, wrong types, unknown keys,
 * unknown placeholder, unbalanced braces), DUET_ERR_UNSUPPORTED (a version other than 1),
 * DUET_ERR_NOT_FOUND (the default template needs a "<|bos|>" special the tokenizer lacks),
 * DUET_ERR_NOMEM. The detail is in duet_error_last() and logged.
 * `tok` must outlive the template.
 */
duet_status_t duet_oai_template_create(const char *json, size_t len, const char *source,
                                       const duet_tokenizer_t *tok, duet_oai_template_t **tmpl_p);

/*
 * The template for a model folder, first found of: `dir/chat_template.json` (duet's format),
 * `dir/chat_template.jinja`, the string "chat_template" of `dir/tokenizer_config.json` (Jinja,
 * parsed once here: a template outside the supported subset or malformed is refused with
 * file:line:column, start-up refuses rather than guess), else the default.
 */
duet_status_t duet_oai_template_load(const char *dir, const duet_tokenizer_t *tok,
                                     duet_oai_template_t **tmpl_p);

/* Free a template; NULL is fine. */
void duet_oai_template_destroy(duet_oai_template_t *tmpl);

/*
 * Apply the template to n_msgs messages and tokenize with `tok` (the one the template was
 * compiled for). *ids_p receives a malloc'd array (free() it) of *n_p ids. Errors:
 * DUET_ERR_INVALID (NULL arguments, a tokenizer other than the template's), DUET_ERR_NOMEM,
 * tokenizer errors.
 */
duet_status_t duet_oai_chat_prompt(const duet_oai_template_t *tmpl, const duet_tokenizer_t *tok,
                                   const duet_oai_message_t *msgs, size_t n_msgs, uint32_t **ids_p,
                                   size_t *n_p);

/*
 * A /v1/completions text prompt: the template's completion_prefix, then `text` as ordinary text
 * (special-token text in it is not recognised). Same output convention as duet_oai_chat_prompt.
 */
duet_status_t duet_oai_completion_prompt(const duet_oai_template_t *tmpl,
                                         const duet_tokenizer_t *tok, const char *text, size_t len,
                                         uint32_t **ids_p, size_t *n_p);

#endif
