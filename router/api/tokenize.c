/*
 * vLLM's /tokenize and /detokenize (see tokenize.h). Messages are validated by the chat
 * completions parser itself (a chat body is made of them), so that /tokenize counts exactly what
 * /v1/chat/completions would send.
 */
#include "router/api/tokenize.h"

#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "common/json.h"

/* The body as a JSON object, checked against the endpoint's fields (`known`, NULL-terminated;
 * others are ignored unless lim->strict) and "model". */
static duet_status_t tk_load(const duet_oai_limits_t *lim, const char *body, size_t len,
                             const char *const *known, json_t **root_p, duet_oai_error_t *err)
{
    *root_p = NULL;
    if (lim->max_body_bytes > 0 && len > lim->max_body_bytes) {
        duet_oai_error_make(err, 413, NULL, "request_too_large", NULL,
                            "The request body of %zu bytes is larger than the limit of %zu bytes.",
                            len, lim->max_body_bytes);
        return DUET_ERR_RANGE;
    }
    json_t *root = NULL;
    if (duet_json_load_buffer(body != NULL ? body : "", len, "request body", (size_t)-1, &root) !=
        DUET_OK)
        return duet_oai_error_make(err, 400, NULL, NULL, NULL,
                                   "We could not parse the JSON body of your request: %s.",
                                   duet_error_last());
    if (!json_is_object(root)) {
        json_decref(root);
        return duet_oai_error_make(err, 400, NULL, NULL, NULL,
                                   "The request body must be a JSON object.");
    }
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val)
    {
        bool ok = false;
        for (size_t i = 0; known[i] != NULL && !ok; i++)
            ok = strcmp(key, known[i]) == 0;
        if (!ok && lim->strict) {
            duet_status_t st = duet_oai_error_make(err, 400, NULL, "unrecognized_argument", key,
                                                   "Unrecognized request argument supplied: "
                                                   "%.100s",
                                                   key);
            json_decref(root); /* key lives in root */
            return st;
        }
    }
    json_t *model = json_object_get(root, "model");
    const char *name = lim->model_name != NULL ? lim->model_name : "";
    duet_status_t st = DUET_OK;
    if (model != NULL && !json_is_null(model) && !json_is_string(model))
        st = duet_oai_error_make(err, 400, NULL, "invalid_type", "model",
                                 "Invalid type for 'model': expected a string.");
    else if (json_is_string(model) && strcmp(json_string_value(model), name) != 0)
        st = duet_oai_error_make(err, 404, NULL, "model_not_found", "model",
                                 "The model `%.200s` does not exist. This server serves `%.200s`.",
                                 json_string_value(model), name);
    if (st != DUET_OK) {
        json_decref(root);
        return st;
    }
    *root_p = root;
    return DUET_OK;
}

/* An optional boolean field (absent / null: def). */
static duet_status_t tk_bool(const json_t *root, const char *key, bool def, bool *v_p,
                             duet_oai_error_t *err)
{
    const json_t *v = json_object_get(root, key);
    *v_p = def;
    if (v == NULL || json_is_null(v))
        return DUET_OK;
    if (!json_is_boolean(v))
        return duet_oai_error_make(err, 400, NULL, "invalid_type", key,
                                   "Invalid type for '%s': expected a boolean.", key);
    *v_p = json_is_true(v);
    return DUET_OK;
}

static duet_status_t tk_nomem(duet_oai_error_t *err)
{
    duet_oai_error_make(err, 500, "server_error", NULL, NULL, "The server ran out of memory.");
    return DUET_ERR_NOMEM;
}

/* The ids of {"messages", "add_generation_prompt"?, "tools"?}: the chat parser validates them. */
static duet_status_t tk_messages(const duet_oai_limits_t *lim, const duet_oai_template_t *tmpl,
                                 const duet_tokenizer_t *tok, json_t *root, uint32_t **ids_p,
                                 size_t *n_p, duet_oai_error_t *err)
{
    bool gen;
    duet_status_t st = tk_bool(root, "add_generation_prompt", true, &gen, err);
    if (st != DUET_OK)
        return st;
    json_t *chat =
        json_pack("{s:s, s:O, s:i}", "model", lim->model_name != NULL ? lim->model_name : "",
                  "messages", json_object_get(root, "messages"), "max_tokens", 1);
    json_t *tools = json_object_get(root, "tools");
    if (chat != NULL && tools != NULL)
        json_object_set(chat, "tools", tools);
    char *text = chat != NULL ? json_dumps(chat, JSON_COMPACT) : NULL;
    json_decref(chat);
    if (text == NULL)
        return tk_nomem(err);
    duet_oai_limits_t l = *lim;
    l.max_body_bytes = 0; /* the client's body was checked already */
    duet_oai_request_t req;
    st = duet_oai_request_parse(&l, DUET_OAI_ENDPOINT_CHAT, text, strlen(text), &req, err);
    free(text);
    if (st != DUET_OK)
        return st;
    if (duet_oai_template_is_jinja(tmpl)) {
        duet_oai_chat_t c = {
            .messages = req.messages_json, .tools = req.tools, .add_generation_prompt = gen};
        st = duet_oai_chat_prompt_json(tmpl, tok, &c, ids_p, n_p);
    } else {
        st = duet_oai_chat_prompt_ex(tmpl, tok, req.messages, req.n_messages, gen, ids_p, n_p);
    }
    duet_oai_request_free(&req);
    if (st == DUET_ERR_NOMEM)
        return tk_nomem(err);
    if (st != DUET_OK)
        return duet_oai_error_make(err, 400, NULL, "invalid_value", "messages",
                                   "The model's chat template cannot render these messages: %s",
                                   duet_error_last());
    return DUET_OK;
}

duet_status_t duet_oai_tokenize(const duet_oai_limits_t *lim, const duet_oai_template_t *tmpl,
                                const duet_tokenizer_t *tok, const char *body, size_t len,
                                duet_strbuf_t *out, duet_oai_error_t *err)
{
    static const char *const known[] = {
        "model", "prompt", "messages", "add_generation_prompt", "add_special_tokens",
        "tools", NULL};
    json_t *root;
    duet_status_t st = tk_load(lim, body, len, known, &root, err);
    if (st != DUET_OK)
        return st;
    json_t *prompt = json_object_get(root, "prompt"), *msgs = json_object_get(root, "messages");
    prompt = json_is_null(prompt) ? NULL : prompt;
    msgs = json_is_null(msgs) ? NULL : msgs;
    bool special;
    uint32_t *ids = NULL;
    size_t n = 0;
    if ((st = tk_bool(root, "add_special_tokens", true, &special, err)) != DUET_OK)
        goto out;
    if ((prompt == NULL) == (msgs == NULL)) {
        st = duet_oai_error_make(err, 400, NULL, "missing_required_parameter",
                                 prompt == NULL ? "prompt" : "messages",
                                 "Give exactly one of 'prompt' (a string) and 'messages'.");
        goto out;
    }
    if (msgs != NULL) {
        st = tk_messages(lim, tmpl, tok, root, &ids, &n, err);
        goto out;
    }
    if (json_object_get(root, "tools") != NULL && !json_is_null(json_object_get(root, "tools"))) {
        st = duet_oai_error_make(err, 400, NULL, "invalid_value", "tools",
                                 "'tools' goes with 'messages', not with a 'prompt'.");
        goto out;
    }
    if (!json_is_string(prompt)) {
        st = duet_oai_error_make(err, 400, NULL, "invalid_type", "prompt",
                                 "Invalid type for 'prompt': expected a string.");
        goto out;
    }
    const char *text = json_string_value(prompt);
    size_t tlen = json_string_length(prompt);
    if (special) {
        st = duet_oai_completion_prompt(tmpl, tok, text, tlen, &ids, &n);
    } else {
        st = duet_tokenizer_encode(tok, text, tlen, 0, NULL, 0, &n);
        if (st == DUET_ERR_NO_SPACE || (st == DUET_OK && n == 0)) {
            ids = malloc((n > 0 ? n : 1) * sizeof(*ids));
            st = ids == NULL ? DUET_ERR_NOMEM
                 : n == 0    ? DUET_OK
                             : duet_tokenizer_encode(tok, text, tlen, 0, ids, n, &n);
        }
    }
    if (st != DUET_OK) {
        st = st == DUET_ERR_NOMEM
                 ? tk_nomem(err)
                 : duet_oai_error_make(err, 500, "server_error", NULL, NULL,
                                       "The prompt could not be tokenized: %s", duet_error_last());
    }
out:
    json_decref(root);
    if (st == DUET_OK) {
        duet_strbuf_printf(out, "{\"count\":%zu,\"max_model_len\":", n);
        if (lim->max_context > 0)
            duet_strbuf_printf(out, "%zu", lim->max_context);
        else
            duet_strbuf_puts(out, "null");
        duet_strbuf_puts(out, ",\"tokens\":[");
        for (size_t i = 0; i < n; i++)
            duet_strbuf_printf(out, "%s%u", i > 0 ? "," : "", ids[i]);
        duet_strbuf_puts(out, "]}");
        st = duet_strbuf_status(out);
        if (st != DUET_OK)
            st = tk_nomem(err);
    }
    free(ids);
    return st;
}

duet_status_t duet_oai_detokenize(const duet_oai_limits_t *lim, const duet_tokenizer_t *tok,
                                  const char *body, size_t len, duet_strbuf_t *out,
                                  duet_oai_error_t *err)
{
    static const char *const known[] = {"model", "tokens", NULL};
    json_t *root;
    duet_status_t st = tk_load(lim, body, len, known, &root, err);
    if (st != DUET_OK)
        return st;
    json_t *arr = json_object_get(root, "tokens");
    uint32_t *ids = NULL;
    char *text = NULL;
    size_t n = json_array_size(arr), tlen = 0;
    if (arr == NULL || json_is_null(arr)) {
        st = duet_oai_error_make(err, 400, NULL, "missing_required_parameter", "tokens",
                                 "Missing required parameter: 'tokens'.");
        goto out;
    }
    if (!json_is_array(arr)) {
        st = duet_oai_error_make(err, 400, NULL, "invalid_type", "tokens",
                                 "Invalid type for 'tokens': expected an array of token ids.");
        goto out;
    }
    if ((ids = malloc((n > 0 ? n : 1) * sizeof(*ids))) == NULL) {
        st = tk_nomem(err);
        goto out;
    }
    uint32_t vocab = lim->vocab_size > 0 ? lim->vocab_size : duet_tokenizer_vocab_size(tok);
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(arr, i);
        char where[48];
        snprintf(where, sizeof(where), "tokens[%zu]", i);
        json_int_t id = json_is_integer(e) ? json_integer_value(e) : -1;
        if (id < 0 || id >= (json_int_t)vocab) {
            st = duet_oai_error_make(err, 400, NULL, "invalid_value", where,
                                     "Invalid '%s': token ids are integers in [0, %u).", where,
                                     vocab);
            goto out;
        }
        ids[i] = (uint32_t)id;
    }
    st = duet_tokenizer_decode(tok, ids, n, NULL, 0, &tlen);
    if (st == DUET_OK || st == DUET_ERR_NO_SPACE) {
        text = malloc(tlen + 1);
        st = text == NULL ? DUET_ERR_NOMEM : duet_tokenizer_decode(tok, ids, n, text, tlen, &tlen);
    }
    if (st == DUET_ERR_NOMEM)
        st = tk_nomem(err);
    else if (st != DUET_OK) /* a gap in the vocabulary */
        st = duet_oai_error_make(err, 400, NULL, "invalid_value", "tokens", "Invalid 'tokens': %s",
                                 duet_error_last());
    if (st == DUET_OK) {
        duet_strbuf_puts(out, "{\"prompt\":");
        duet_oai_json_string(out, text, tlen);
        duet_strbuf_puts(out, "}");
        if (duet_strbuf_status(out) != DUET_OK)
            st = tk_nomem(err);
    }
out:
    free(text);
    free(ids);
    json_decref(root);
    return st;
}
