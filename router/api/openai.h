/*
 * The OpenAI API layer of the router, as pure functions (no sockets, no event loop):
 *
 *   body bytes --duet_oai_request_parse--> duet_oai_request_t (validated) or duet_oai_error_t
 *   request    --duet_oai_request_tokens--> prompt ids (chat template / completion prompt)
 *   token ids  --duet_oai_stream_feed-----> text deltas + finish reason (UTF-8 safe, stop strings)
 *   text       --duet_oai_response_json / duet_oai_sse_*--> the exact bytes to send
 *
 * What the official `openai` Python client expects is the contract: the field names, the object
 * types ("text_completion", "chat.completion", "chat.completion.chunk"), the first chat chunk
 * carrying delta.role "assistant", the usage-only chunk with empty choices under
 * stream_options.include_usage (and "usage": null on every other chunk then), and errors as
 * {"error": {"message", "type", "param", "code"}}.
 *
 * Validation policy. Every field the OpenAI API defines for the endpoint is either used, accepted
 * because its value changes nothing (user, best_of equal to n, ...), or refused with 400
 * "unsupported_parameter" naming it (functions, suffix, audio, ...).
 * Log-probabilities and logit processing (logprobs, top_logprobs, echo, presence_penalty,
 * frequency_penalty, logit_bias and the vLLM extensions repetition_penalty, min_tokens,
 * stop_token_ids) are read by openai_logprobs.c.
 * A top-level field the endpoint does not define (other than the vLLM extensions ignore_eos,
 * top_k, skip_special_tokens, repetition_penalty, min_tokens and stop_token_ids) is accepted and
 * ignored, as vLLM and SGLang do, so that clients
 * sending newer or other servers' fields keep working; its name is listed in the request's
 * ignored_fields (the router logs each name once). Under lim->strict (the router's api.strict) it
 * is refused as OpenAI refuses it ("Unrecognized request argument supplied"). Unknown keys inside
 * a message, a tool call or stream_options are always refused. JSON null means "absent" for
 * every optional field. Status codes: 400 for every validation error (as OpenAI), 404
 * model_not_found, 413 for a body over the limit; 422 is not used by the parser (the HTTP layer
 * may use duet_oai_error_make for its own errors: 429, 503, 500).
 *
 * Threads: every function is reentrant; a duet_oai_stream_t belongs to one request.
 */
#ifndef DUET_ROUTER_OPENAI_H
#define DUET_ROUTER_OPENAI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "common/strbuf.h"
#include "tokenizer/tokenizer.h"
#include "router/api/chat_template.h"
#include "router/api/tools.h"

struct json_t;

#define DUET_OAI_MAX_STOP     4   /* stop strings per request (OpenAI's limit) */
#define DUET_OAI_MAX_STOP_LEN 256 /* bytes per stop string (ours: bounds the hold-back buffer) */
#define DUET_OAI_MAX_EOS      8   /* end-of-sequence ids a stream watches */
#define DUET_OAI_MAX_N        16  /* choices per request (n, best_of) */

typedef enum {
    DUET_OAI_ENDPOINT_COMPLETIONS = 0, /* POST /v1/completions */
    DUET_OAI_ENDPOINT_CHAT,            /* POST /v1/chat/completions */
} duet_oai_endpoint_t;

/* Limits and defaults of the served model, fixed at start-up. */
typedef struct {
    const char *model_name;      /* the served name; requests must name it; not owned */
    uint32_t max_tokens_default; /* max_tokens when the request gives none (at most the cap) */
    uint32_t max_tokens_cap;     /* largest max_tokens accepted */
    size_t max_body_bytes;       /* larger bodies get 413 */
    uint32_t vocab_size;         /* token-id prompts must be < this (0 = not checked) */
    size_t max_prompt_tokens;    /* longest prompt (0 = no limit); see duet_oai_request_tokens */
    size_t max_context;          /* prompt + max_tokens limit (0 = no limit) */
    size_t max_messages;         /* longest messages array (0 = 1024) */
    bool jinja_template;         /* the chat template is Jinja: tool messages (role "tool",
                                    tool_call_id) and assistant tool_calls are accepted in the
                                    conversation; with duet's format they are a 400 */
    bool strict;                 /* api.strict: unknown top-level fields are a 400 */
    bool tool_calls;             /* the tokenizer has Kimi K2's tool-call tokens (tools.h) */
} duet_oai_limits_t;

/* logit_bias entries per request at most (OpenAI's limit; the worker keeps as many). */
#define DUET_OAI_MAX_LOGIT_BIAS 300

/*
 * Logit processing and log-probabilities of a request (router/api/openai_logprobs.h parses them;
 * docs/architecture.md, "Sampling", says what they do).
 */
typedef struct {
    double presence_penalty, frequency_penalty; /* [-2, 2], 0 = off */
    double repetition_penalty;                  /* > 0, 1 = off (the default) */
    uint32_t *bias_ids;                         /* (n_bias) owned, < vocab_size */
    float *bias;                                /* (n_bias) owned, [-100, 100] */
    size_t n_bias;
    uint32_t min_tokens;   /* <= max_tokens */
    bool logprobs;         /* chat: logprobs true; completions: logprobs given */
    uint32_t top_logprobs; /* chat: top_logprobs (0..20); completions: logprobs (0..5) */
    bool echo;             /* completions: the prompt comes first in the text (and logprobs) */
    uint32_t stop_token_ids[DUET_OAI_MAX_EOS]; /* vLLM: ids that end the choice with "stop" */
    size_t n_stop_token_ids;
} duet_oai_lp_params_t;

/* A validated request. Every pointer is owned by the request (duet_oai_request_free). */
typedef struct {
    duet_oai_endpoint_t endpoint;
    /* /v1/completions: exactly one of prompt (text) or prompt_ids is set. */
    char *prompt;         /* NUL-terminated, valid UTF-8, may hold NULs; NULL when ids */
    size_t prompt_len;    /* bytes */
    uint32_t *prompt_ids; /* (n_prompt_ids) when the prompt was given as token ids */
    size_t n_prompt_ids;
    /* /v1/chat/completions */
    duet_oai_message_t *messages; /* (n_messages) role and text, for duet's template format */
    size_t n_messages;
    struct json_t *messages_json; /* the validated "messages" array (a reference), which a Jinja
                                     template reads as it came in */
    /* sampling and stopping */
    uint32_t max_tokens; /* >= 1 and <= the cap; max_completion_tokens wins in chat; 0 only for
                            a completion with echo (prompt scoring) */
    double temperature;  /* [0, 2], default 1 (0 = greedy) */
    double top_p;        /* (0, 1], default 1 */
    int64_t top_k;       /* vLLM extension: 0 = no limit (-1 is read as 0) */
    bool has_seed;
    int64_t seed;
    char *stop[DUET_OAI_MAX_STOP]; /* (n_stop) non-empty, <= DUET_OAI_MAX_STOP_LEN bytes */
    size_t stop_len[DUET_OAI_MAX_STOP];
    size_t n_stop;
    bool ignore_eos; /* vLLM extension */
    /* vLLM extension, default true: special tokens the tokenizer skips (duet_tokenizer_is_skipped)
     * produce no text; false: their text is part of the output (stop ids never are) */
    bool skip_special_tokens;
    uint32_t n;       /* choices, [1, DUET_OAI_MAX_N]: each an independent generation (seed + i) */
    uint32_t best_of; /* completions: generations run, [n, DUET_OAI_MAX_N] (n when absent); the
                         n with the highest mean log-probability per token are returned */
    bool stream;
    bool include_usage;            /* stream_options.include_usage (only with stream) */
    char *user;                    /* NULL when absent; for logs */
    struct json_t *ignored_fields; /* unknown top-level field names ignored (not strict): an
                                      array of strings; NULL when none */
    struct json_t *tools; /* chat: the validated "tools" (a reference) when offered (given, not
                             empty, tool_choice not "none"); then the output is parsed for
                             tool calls (tools.h) */
    duet_oai_tool_choice_t tool_choice;
    duet_oai_lp_params_t lp;
    const char *response_format; /* static: NULL (text), "json_object" or "json_schema"
                                    (response_format.h) */
    char *json_schema;           /* owned, "json_schema": the schema's compact JSON text */
} duet_oai_request_t;

/* An OpenAI error, ready to serialise. Strings are truncated to fit (at a UTF-8 boundary). */
typedef struct {
    int http_status; /* 400, 404, 413, 429, 500, 503 ... */
    char type[32];   /* "invalid_request_error", "server_error", ... */
    char code[48];   /* "model_not_found", "invalid_value", ...; "" serialises as null */
    char param[128]; /* "messages[2].role"; "" serialises as null */
    char message[512];
} duet_oai_error_t;

/* Why a choice ended. */
typedef enum {
    DUET_OAI_FINISH_NONE = 0,   /* still generating */
    DUET_OAI_FINISH_STOP,       /* EOS or a stop string */
    DUET_OAI_FINISH_LENGTH,     /* max_tokens (or the context) reached */
    DUET_OAI_FINISH_TOOL_CALLS, /* stopped after tool calls (tools.h) */
} duet_oai_finish_t;

/* "stop", "length", "tool_calls"; NULL for NONE. */
const char *duet_oai_finish_name(duet_oai_finish_t f);

/* ---------------------------------------------------------------- errors */

/*
 * Fill *err (type "invalid_request_error" when type is NULL; code/param NULL = null) and return
 * DUET_ERR_INVALID, so a validator can write `return duet_oai_error_make(err, 400, ...)`.
 */
duet_status_t duet_oai_error_make(duet_oai_error_t *err, int http_status, const char *type,
                                  const char *code, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

/* Append {"error":{"message":...,"type":...,"param":...,"code":...}} to out. */
duet_status_t duet_oai_error_json(const duet_oai_error_t *err, duet_strbuf_t *out);

/* Append the error as one SSE event ("data: {...}\n\n"), for failures after a stream began. */
duet_status_t duet_oai_sse_error(const duet_oai_error_t *err, duet_strbuf_t *out);

/* ---------------------------------------------------------------- requests */

/*
 * Parse and validate a request body of `len` bytes for `endpoint` under `lim`.
 * DUET_OK: *req_p is filled (free it with duet_oai_request_free), *err_p untouched.
 * Bad input: DUET_ERR_INVALID (DUET_ERR_RANGE for 413), *err_p says what to answer, *req_p is
 * zeroed. DUET_ERR_NOMEM: *err_p is a 500. Never logs: the caller logs with its request id.
 */
duet_status_t duet_oai_request_parse(const duet_oai_limits_t *lim, duet_oai_endpoint_t endpoint,
                                     const char *body, size_t len, duet_oai_request_t *req_p,
                                     duet_oai_error_t *err_p);

/* Free what a parsed request owns and zero it. NULL and zeroed requests are fine. */
void duet_oai_request_free(duet_oai_request_t *req);

/*
 * The prompt's token ids: chat messages through the template, a text prompt after the template's
 * completion_prefix, token ids as given. *ids_p is malloc'd (free() it). A prompt of zero tokens,
 * one over lim->max_prompt_tokens, or prompt + max_tokens over lim->max_context is a 400 in
 * *err_p (code "context_length_exceeded" for the last two) and DUET_ERR_INVALID.
 */
duet_status_t duet_oai_request_tokens(const duet_oai_request_t *req, const duet_oai_limits_t *lim,
                                      const duet_oai_template_t *tmpl, const duet_tokenizer_t *tok,
                                      uint32_t **ids_p, size_t *n_p, duet_oai_error_t *err_p);

/* ---------------------------------------------------------------- streaming text */

typedef struct duet_oai_stream duet_oai_stream_t;

/*
 * Text state of one choice: detokenizer (UTF-8 safe, special tokens give no text unless
 * req->skip_special_tokens is false), stop strings,
 * EOS and max_tokens. eos_ids (n_eos <= DUET_OAI_MAX_EOS) end the text with "stop" unless
 * req->ignore_eos. Copies what it needs from req. When keep_text is set the whole emitted text is
 * also kept (duet_oai_stream_text), for non-streaming responses. Buffers are sized here: feeding
 * allocates only to grow the kept text.
 */
duet_status_t duet_oai_stream_create(const duet_tokenizer_t *tok, const duet_oai_request_t *req,
                                     const uint32_t *eos_ids, size_t n_eos, bool keep_text,
                                     duet_oai_stream_t **s_p);

/* Free; NULL is fine. */
void duet_oai_stream_destroy(duet_oai_stream_t *s);

/*
 * Feed one generated id. *text_p and *len_p receive the text to emit now (possibly empty; pointer
 * valid until the next call on s); *finish_p is NONE while the choice goes on. Text that could be
 * the start of a stop string is held back until it is known not to be one. When a stop string
 * completes, the text before it is emitted and the choice ends with "stop" (the stop string is
 * not emitted); an EOS id ends it with "stop"; the max_tokens-th id with "length" (a stop string
 * completed by that id wins). At the end every held byte is emitted (an unfinished UTF-8
 * character as U+FFFD). Feeding a finished stream is DUET_ERR_INVALID; an id outside the
 * vocabulary is DUET_ERR_RANGE (state unchanged).
 */
duet_status_t duet_oai_stream_feed(duet_oai_stream_t *s, uint32_t id, const char **text_p,
                                   size_t *len_p, duet_oai_finish_t *finish_p);

/*
 * End the choice from outside (the worker stopped: context full, drain) with `finish`
 * (STOP or LENGTH); emits the held text like the end of duet_oai_stream_feed. A stop string
 * completed by the held text still cuts it (and the reason becomes "stop").
 */
duet_status_t duet_oai_stream_finish(duet_oai_stream_t *s, duet_oai_finish_t finish,
                                     const char **text_p, size_t *len_p,
                                     duet_oai_finish_t *finish_p);

/* Ids fed so far (completion_tokens of usage; an EOS id counts, as in vLLM). */
uint32_t duet_oai_stream_n_tokens(const duet_oai_stream_t *s);

/* The whole text emitted so far (keep_text streams; "" otherwise). Valid until the next call. */
void duet_oai_stream_text(const duet_oai_stream_t *s, const char **text_p, size_t *len_p);

/* ---------------------------------------------------------------- responses */

/* What every object of one response shares. */
typedef struct {
    duet_oai_endpoint_t endpoint;
    const char *id;     /* "cmpl-..." / "chatcmpl-..." (duet_oai_response_id); not owned */
    const char *model;  /* the served model name; not owned */
    int64_t created;    /* unix seconds */
    bool include_usage; /* streaming: usage null on chunks, then a usage chunk */
    uint32_t index;     /* the choice the chunks written with this meta belong to (n > 1) */
    /* The JSON written as choices[].logprobs of the next content / finish chunk (streaming) or of
     * duet_oai_response_json's one choice (router/api/openai_logprobs.h builds it); NULL: null.
     * Not owned. */
    const char *logprobs_json;
} duet_oai_resp_meta_t;

/* One finished choice of a non-streaming response. */
typedef struct {
    const char *text; /* not owned */
    size_t len;
    duet_oai_finish_t finish;
    const char *tool_calls_json; /* chat: NULL, or the message's "tool_calls" array as JSON (then
                                    an empty text is "content": null); not owned */
    const char *logprobs_json;   /* the choice's "logprobs" as JSON (openai_logprobs.h); NULL:
                                    null; not owned */
} duet_oai_choice_t;

/* Write "cmpl-<16 hex>" or "chatcmpl-<16 hex>" from a request id into buf (cap >= 26). */
void duet_oai_response_id(duet_oai_endpoint_t endpoint, uint64_t req_id, char *buf, size_t cap);

/* Append a whole text_completion / chat.completion object with usage (one choice, index 0). */
duet_status_t duet_oai_response_json(const duet_oai_resp_meta_t *m, const char *text, size_t len,
                                     duet_oai_finish_t finish, uint32_t prompt_tokens,
                                     uint32_t completion_tokens, duet_strbuf_t *out);

/* The same with n choices (index i = choices[i]); completion_tokens summed over them. */
duet_status_t duet_oai_response_json_n(const duet_oai_resp_meta_t *m,
                                       const duet_oai_choice_t *choices, size_t n,
                                       uint32_t prompt_tokens, uint32_t completion_tokens,
                                       duet_strbuf_t *out);

/*
 * Streaming, each call appends whole SSE events ("data: {...}\n\n"):
 *   duet_oai_sse_begin  chat: the role chunk (delta {"role":"assistant","content":""});
 *                       completions: nothing.
 *   duet_oai_sse_delta  one content chunk; nothing for len 0.
 *   duet_oai_sse_end    the finish chunk (empty delta / text, finish_reason), then with
 *                       include_usage the usage chunk ("choices": []), then "data: [DONE]\n\n".
 * The chunks carry choice m->index. With n > 1 choices interleaved, each choice has its begin,
 * deltas and duet_oai_sse_finish (its finish chunk); duet_oai_sse_done then closes the stream
 * (the usage chunk, summed over the choices, and [DONE]); duet_oai_sse_end = finish + done.
 */
duet_status_t duet_oai_sse_begin(const duet_oai_resp_meta_t *m, duet_strbuf_t *out);
duet_status_t duet_oai_sse_delta(const duet_oai_resp_meta_t *m, const char *text, size_t len,
                                 duet_strbuf_t *out);
duet_status_t duet_oai_sse_end(const duet_oai_resp_meta_t *m, duet_oai_finish_t finish,
                               uint32_t prompt_tokens, uint32_t completion_tokens,
                               duet_strbuf_t *out);
duet_status_t duet_oai_sse_finish(const duet_oai_resp_meta_t *m, duet_oai_finish_t finish,
                                  duet_strbuf_t *out);
/* A chat chunk whose delta is the JSON object `delta` (len bytes, written as it is: tool-call
 * deltas, tools.h). */
duet_status_t duet_oai_sse_delta_json(const duet_oai_resp_meta_t *m, const char *delta, size_t len,
                                      duet_strbuf_t *out);
duet_status_t duet_oai_sse_done(const duet_oai_resp_meta_t *m, uint32_t prompt_tokens,
                                uint32_t completion_tokens, duet_strbuf_t *out);

/* Internal (tools.c): "tools" and "tool_choice" of a chat request's body into req. */
duet_status_t duet__oai_parse_tools(const duet_oai_limits_t *lim, const struct json_t *root,
                                    duet_oai_request_t *req, duet_oai_error_t *err);

/* Append s (len bytes) as a JSON string literal; ill-formed UTF-8 becomes U+FFFD. */
duet_status_t duet_oai_json_string(duet_strbuf_t *out, const char *s, size_t len);

#endif
