/*
 * Tool calling on /v1/chat/completions (docs/architecture.md, "The OpenAI API surface"), as pure
 * functions beside openai.h:
 *
 *   request   "tools", "tool_choice" --duet__oai_parse_tools--> req->tools, req->tool_choice
 *   template  req->tools reaches the checkpoint's Jinja template as transformers passes `tools`
 *   output    the choice's text --duet_oai_toolparse_feed--> content + tool calls (Kimi K2's
 * format)
 *
 * The format is Kimi K2's, recognised in the generated text (the markers are special tokens the
 * detokenizer shows: a request with tools decodes with skip_special_tokens off, as vLLM's parser
 * asks):
 *
 *   content<|tool_calls_section_begin|>
 *     <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>
 *     ...
 *   <|tool_calls_section_end|>
 *
 * Each call becomes an OpenAI tool call {id: "functions.NAME:IDX" (Kimi's own id, as vLLM
 * returns it), type: "function", function: {name: NAME, arguments: the text between the
 * markers, blanks around it trimmed}}; the arguments are passed on as the model wrote them (not
 * validated as JSON). Text before the section is the content; text between calls is dropped;
 * text after the section end is content again. A call the output ends inside of is dropped.
 * Without constrained decoding nothing forces the model to call (or not to call) a tool:
 * tool_choice "required" and a named function are accepted and validated (the name must be among
 * the tools) but the answer is what the model produced.
 */
#ifndef DUET_ROUTER_TOOLS_H
#define DUET_ROUTER_TOOLS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "common/strbuf.h"

#define DUET_OAI_MAX_TOOLS       128 /* tools per request */
#define DUET_OAI_MAX_TOOL_ID_LEN 256 /* bytes of a generated call id ("functions.NAME:IDX") */

/* The special-token texts of Kimi K2's tool-call format. */
#define DUET_OAI_TOOL_SECTION_BEGIN "<|tool_calls_section_begin|>"
#define DUET_OAI_TOOL_SECTION_END   "<|tool_calls_section_end|>"
#define DUET_OAI_TOOL_CALL_BEGIN    "<|tool_call_begin|>"
#define DUET_OAI_TOOL_ARG_BEGIN     "<|tool_call_argument_begin|>"
#define DUET_OAI_TOOL_CALL_END      "<|tool_call_end|>"

typedef enum {
    DUET_OAI_TOOL_CHOICE_AUTO = 0, /* "auto" (the default with tools) */
    DUET_OAI_TOOL_CHOICE_NONE,     /* "none": no tools offered, no calls parsed */
    DUET_OAI_TOOL_CHOICE_REQUIRED, /* "required": as auto (not enforced) */
    DUET_OAI_TOOL_CHOICE_NAMED,    /* {"type":"function","function":{"name"}}: as auto */
} duet_oai_tool_choice_t;

/* ---------------------------------------------------------------- the parsed output */

typedef struct duet_oai_toolparse duet_oai_toolparse_t;

typedef enum {
    DUET_OAI_TP_CONTENT = 0, /* text: content */
    DUET_OAI_TP_CALL,        /* call `call` begins: id (text) and name */
    DUET_OAI_TP_ARGS,        /* text: more of call `call`'s arguments */
} duet_oai_tp_kind_t;

typedef struct {
    duet_oai_tp_kind_t kind;
    uint32_t call;    /* CALL, ARGS: the call's index (0, 1, ...) */
    const char *text; /* CONTENT, ARGS: the text; CALL: the id */
    size_t len;
    const char *name; /* CALL: the function's name */
    size_t name_len;
} duet_oai_tp_event_t;

/* A parser for one choice's text. DUET_ERR_NOMEM. */
duet_status_t duet_oai_toolparse_create(duet_oai_toolparse_t **tp_p);

/* Free; NULL is fine. */
void duet_oai_toolparse_destroy(duet_oai_toolparse_t *tp);

/*
 * Feed the next `len` bytes of the choice's text; `end`: no more text comes (what is held is
 * settled: held content is emitted, an unfinished call dropped). *ev_p receives *n_p events, in
 * order, valid until the next call on tp. Text that may begin a marker is held back until it is
 * known. The parser also keeps the whole content and every complete call (below).
 * DUET_ERR_NOMEM; DUET_ERR_INVALID after the end.
 */
duet_status_t duet_oai_toolparse_feed(duet_oai_toolparse_t *tp, const char *text, size_t len,
                                      bool end, const duet_oai_tp_event_t **ev_p, size_t *n_p);

/* Complete calls so far. */
uint32_t duet_oai_toolparse_n_calls(const duet_oai_toolparse_t *tp);

/* The content emitted so far (valid until the next feed). */
void duet_oai_toolparse_content(const duet_oai_toolparse_t *tp, const char **text_p, size_t *len_p);

/* Append the complete calls as an OpenAI "tool_calls" array: [{"id","type","function":{"name",
 * "arguments"}}, ...]. */
duet_status_t duet_oai_toolparse_calls_json(const duet_oai_toolparse_t *tp, duet_strbuf_t *out);

/* Append a streaming delta object for one event of kind CALL or ARGS:
 * {"tool_calls":[{"index":i,"id":...,"type":"function","function":{"name":...,"arguments":""}}]}
 * or {"tool_calls":[{"index":i,"function":{"arguments":...}}]}. */
duet_status_t duet_oai_tool_delta_json(const duet_oai_tp_event_t *ev, duet_strbuf_t *out);

#endif
