/*
 * Chat templates: how a list of chat messages becomes the prompt's token ids.
 *
 * Two sources: a checkpoint's own Jinja template (`chat_template.jinja`, or the string
 * "chat_template" of `tokenizer_config.json`), rendered by router/api/jinja.h exactly as
 * transformers' apply_chat_template renders it, and duet's own small format, documented in
 * router/api/CHAT_TEMPLATE.md:
 *
 *   chat_template.json = {
 *     "duet_chat_template": 1,
 *     "prefix":            "<|bos|>",             text before the first message
 *     "message":           "{role}: {content}\n", one message; {role} and {content} are replaced
 *     "system" / "user" / "assistant": "...",     optional per-role replacement for "message"
 *     "generation_prompt": "assistant: ",         text after the last message (the model's turn)
 *     "completion_prefix": ""                     text before a /v1/completions text prompt
 *                                                 (after the bos id, see below)
 *   }
 *
 * `{{` and `}}` stand for literal braces. Every key but "duet_chat_template" is optional.
 *
 * The built-in default (used when a model folder ships no template) is the demo model's:
 *
 *   <|bos|>system: ...\nuser: ...\nassistant: ...\nassistant:
 *
 * i.e. prefix "<|bos|>", message "{role}: {content}\n", generation_prompt "assistant: ",
 * completion_prefix "". A /v1/completions text prompt starts with the model folder's bos id when
 * its tokenizer adds one (duet_tokenizer_prompt_bos: the demo model's "add_bos"), whatever the
 * template, exactly as duet-generate's --prompt does. Role names are "system", "user", "assistant"
 * (a "developer" message arrives here as system).
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

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "common/status.h"
#include "tokenizer/tokenizer.h"
#include "router/api/jinja.h"

struct json_t;

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
 * A conversation for a Jinja template, as OpenAI JSON: what transformers' apply_chat_template
 * gets as `messages`, `tools`, `documents` and its extra keyword arguments (a request's
 * chat_template_kwargs). Messages are passed to the template unchanged (role, content as a
 * string, null or a list of parts, name, tool_calls, tool_call_id, ...), as DATA; so are the
 * others.
 */
typedef struct {
    const struct json_t *messages;  /* an array */
    const struct json_t *tools;     /* NULL (the template sees None) or an array */
    const struct json_t *documents; /* NULL (None) or an array */
    /* NULL or an object: more variables (enable_thinking, reasoning_effort, ...), set after the
     * special tokens so that they win over them, as transformers merges them. A name among
     * messages, tools, documents and add_generation_prompt is refused (Python's "multiple
     * values for keyword argument"). Names the template does not use are ignored; a variable
     * not given stays undefined, as in transformers. */
    const struct json_t *kwargs;
    bool add_generation_prompt;
    const struct tm *now; /* the instant strftime_now() formats; NULL: local time now */
} duet_oai_chat_t;

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
 * parsed once here: a template outside what duet runs or malformed is refused with
 * file:line:column, start-up refuses rather than guess), else the default. A Jinja template's
 * special-token strings come from special_tokens_map.json, then tokenizer_config.json for those
 * it lacks (the map wins, as in transformers and tokenizer's loader). `tok` may be NULL only
 * when the folder holds a Jinja template that will not be tokenized (duet's format and the default
 * need it).
 */
duet_status_t duet_oai_template_load(const char *dir, const duet_tokenizer_t *tok,
                                     duet_oai_template_t **tmpl_p);

/*
 * A Jinja template from its text (`source` names it in errors). The special-token strings the
 * template sees (bos_token, eos_token, unk_token, sep_token, pad_token, cls_token, mask_token,
 * additional_special_tokens) come from `config`, a parsed tokenizer_config.json (a string or
 * {"content": ...} each; absent ones are undefined in the template, as in transformers), which
 * may be NULL. `tok` may be NULL when the template will only be rendered, never tokenized.
 * Errors: DUET_ERR_FORMAT (malformed or unsupported: "source:L:C: message"), DUET_ERR_NOMEM.
 */
duet_status_t duet_oai_template_create_jinja(const char *text, size_t len, const char *source,
                                             const struct json_t *config,
                                             const duet_tokenizer_t *tok,
                                             duet_oai_template_t **tmpl_p);

/* Set (or replace) a special-token string a Jinja template sees, e.g. "bos_token". Such strings
 * are trusted: special-token text in them is recognised. DUET_ERR_INVALID for duet's format. */
duet_status_t duet_oai_template_set_token(duet_oai_template_t *tmpl, const char *name,
                                          const char *value);

/* True for a Jinja template (false for duet's format and the default). */
bool duet_oai_template_is_jinja(const duet_oai_template_t *tmpl);

/* Free a template; NULL is fine. */
void duet_oai_template_destroy(duet_oai_template_t *tmpl);

/*
 * Render a Jinja template over `chat` into *out (text and TEMPLATE / DATA segments; free with
 * duet_jinja_output_free). Errors: those of duet_jinja_render (DUET_ERR_FORMAT carrying exactly
 * the message of the template's raise_exception), DUET_ERR_INVALID for duet's format or a chat
 * whose messages are not an array, the errors of duet_jinja_from_json.
 */
duet_status_t duet_oai_template_render(const duet_oai_template_t *tmpl, const duet_oai_chat_t *chat,
                                       duet_jinja_output_t *out);

/*
 * Internal: duet_oai_template_render under limits other than jinja.h's defaults (NULL = them), so
 * that the fuzz target (fuzz/fuzz_jinja.c) renders under small ones and a template that runs
 * long within them is a finding.
 */
duet_status_t duet__oai_template_render_limits(const duet_oai_template_t *tmpl,
                                               const duet_oai_chat_t *chat,
                                               const duet_jinja_limits_t *lim,
                                               duet_jinja_output_t *out);

/*
 * Render a Jinja template over `chat` and tokenize: special tokens are recognised only in
 * TEMPLATE segments, the rest is encoded as ordinary text. Same output convention as
 * duet_oai_chat_prompt; errors those of duet_oai_template_render and the tokenizer.
 */
duet_status_t duet_oai_chat_prompt_json(const duet_oai_template_t *tmpl,
                                        const duet_tokenizer_t *tok, const duet_oai_chat_t *chat,
                                        uint32_t **ids_p, size_t *n_p);

/*
 * Apply the template to n_msgs messages (with the generation prompt) and tokenize with `tok`
 * (the one the template was compiled for); a Jinja template sees them as [{role, content}]. *ids_p
 * receives a malloc'd array (free() it) of *n_p ids. Errors: DUET_ERR_INVALID (NULL arguments, a
 * tokenizer other than the template's), DUET_ERR_NOMEM, tokenizer errors.
 */
duet_status_t duet_oai_chat_prompt(const duet_oai_template_t *tmpl, const duet_tokenizer_t *tok,
                                   const duet_oai_message_t *msgs, size_t n_msgs, uint32_t **ids_p,
                                   size_t *n_p);

/* The same with the generation prompt (the assistant's turn) only when add_generation_prompt. */
duet_status_t duet_oai_chat_prompt_ex(const duet_oai_template_t *tmpl, const duet_tokenizer_t *tok,
                                      const duet_oai_message_t *msgs, size_t n_msgs,
                                      bool add_generation_prompt, uint32_t **ids_p, size_t *n_p);

/*
 * A /v1/completions text prompt: the bos id when the model folder's tokenizer adds one (set by
 * duet_oai_template_load; a template made otherwise adds none), the template's
 * completion_prefix, then `text` as ordinary text (special-token text in it is not recognised).
 * Same output convention as duet_oai_chat_prompt.
 */
duet_status_t duet_oai_completion_prompt(const duet_oai_template_t *tmpl,
                                         const duet_tokenizer_t *tok, const char *text, size_t len,
                                         uint32_t **ids_p, size_t *n_p);

#endif
