/* openai_logprobs.c: see openai_logprobs.h. */
#include "router/api/openai_logprobs.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- parsing */

/* The value of an optional field: NULL when absent or JSON null (openai.c's rule). */
static json_t *lp_opt(const json_t *root, const char *key)
{
    json_t *v = json_object_get(root, key);
    return json_is_null(v) ? NULL : v;
}

static duet_status_t lp_bad_type(duet_oai_error_t *err, const char *param, const char *want)
{
    return duet_oai_error_make(err, 400, NULL, "invalid_type", param,
                               "Invalid type for '%s': expected %s.", param, want);
}

/* A number field in [lo, hi] (lo_open: lo excluded) into *v (left as it is when absent). */
static duet_status_t lp_number(const json_t *root, const char *key, double lo, bool lo_open,
                               double hi, double *v, duet_oai_error_t *err)
{
    json_t *j = lp_opt(root, key);
    if (j == NULL)
        return DUET_OK;
    if (!json_is_number(j))
        return lp_bad_type(err, key, "a number");
    const double x = json_number_value(j);
    if (!(lo_open ? x > lo : x >= lo) || !(x <= hi))
        return duet_oai_error_make(err, 400, NULL, "invalid_value", key,
                                   "Invalid '%s': %g is out of range. Expected a value in %s%g, "
                                   "%g].",
                                   key, x, lo_open ? "(" : "[", lo, hi);
    *v = x;
    return DUET_OK;
}

/* An integer field in [lo, hi] into *v (left as it is when absent); *present says whether. */
static duet_status_t lp_int(const json_t *root, const char *key, int64_t lo, int64_t hi, int64_t *v,
                            bool *present, duet_oai_error_t *err)
{
    json_t *j = lp_opt(root, key);
    *present = j != NULL;
    if (j == NULL)
        return DUET_OK;
    if (!json_is_integer(j))
        return lp_bad_type(err, key, "an integer");
    const int64_t x = json_integer_value(j);
    if (x < lo || x > hi)
        return duet_oai_error_make(err, 400, NULL, "invalid_value", key,
                                   "Invalid '%s': %" PRId64 " is out of range. Expected an "
                                   "integer in [%" PRId64 ", %" PRId64 "].",
                                   key, x, lo, hi);
    *v = x;
    return DUET_OK;
}

static duet_status_t lp_parse_bias(const json_t *root, const duet_oai_limits_t *lim,
                                   duet_oai_lp_params_t *lp, duet_oai_error_t *err)
{
    json_t *b = lp_opt(root, "logit_bias");
    if (b == NULL)
        return DUET_OK;
    if (!json_is_object(b))
        return lp_bad_type(err, "logit_bias", "an object");
    const size_t n = json_object_size(b);
    if (n > DUET_OAI_MAX_LOGIT_BIAS)
        return duet_oai_error_make(err, 400, NULL, "invalid_value", "logit_bias",
                                   "Invalid 'logit_bias': %zu entries; at most %d are allowed.", n,
                                   DUET_OAI_MAX_LOGIT_BIAS);
    if (n == 0)
        return DUET_OK;
    lp->bias_ids = malloc(n * sizeof(*lp->bias_ids));
    lp->bias = malloc(n * sizeof(*lp->bias));
    if (lp->bias_ids == NULL || lp->bias == NULL) {
        duet_oai_error_make(err, 500, "server_error", NULL, NULL,
                            "The server ran out of memory while reading the request.");
        return DUET_ERR_NOMEM;
    }
    const char *key;
    json_t *val;
    json_object_foreach(b, key, val)
    {
        char param[96];
        snprintf(param, sizeof(param), "logit_bias.%.64s", key);
        char *end = NULL;
        errno = 0;
        unsigned long long id = key[0] >= '0' && key[0] <= '9' ? strtoull(key, &end, 10) : 0;
        if (end == NULL || *end != '\0' || errno != 0 || id > UINT32_MAX ||
            (lim->vocab_size > 0 && id >= lim->vocab_size))
            return duet_oai_error_make(err, 400, NULL, "invalid_value", param,
                                       "Invalid 'logit_bias': the key \"%.64s\" is not a token id "
                                       "of this model (a decimal integer below %u).",
                                       key, lim->vocab_size);
        if (!json_is_number(val))
            return lp_bad_type(err, param, "a number");
        const double x = json_number_value(val);
        if (!(x >= -100.0 && x <= 100.0))
            return duet_oai_error_make(err, 400, NULL, "invalid_value", param,
                                       "Invalid 'logit_bias': %g for token %llu is out of range. "
                                       "Expected a value in [-100, 100].",
                                       x, id);
        lp->bias_ids[lp->n_bias] = (uint32_t)id;
        lp->bias[lp->n_bias++] = (float)x;
    }
    return DUET_OK;
}

static duet_status_t lp_parse_stop_ids(const json_t *root, const duet_oai_limits_t *lim,
                                       duet_oai_lp_params_t *lp, duet_oai_error_t *err)
{
    json_t *a = lp_opt(root, "stop_token_ids");
    if (a == NULL)
        return DUET_OK;
    if (!json_is_array(a))
        return lp_bad_type(err, "stop_token_ids", "an array of integers");
    if (json_array_size(a) > DUET_OAI_MAX_EOS)
        return duet_oai_error_make(err, 400, NULL, "invalid_value", "stop_token_ids",
                                   "Invalid 'stop_token_ids': %zu ids; at most %d are allowed.",
                                   json_array_size(a), DUET_OAI_MAX_EOS);
    size_t i;
    json_t *id;
    json_array_foreach(a, i, id)
    {
        char param[48];
        snprintf(param, sizeof(param), "stop_token_ids[%zu]", i);
        if (!json_is_integer(id))
            return lp_bad_type(err, param, "an integer");
        const json_int_t v = json_integer_value(id);
        if (v < 0 || v > (json_int_t)UINT32_MAX ||
            (lim->vocab_size > 0 && v >= (json_int_t)lim->vocab_size))
            return duet_oai_error_make(err, 400, NULL, "invalid_value", param,
                                       "Invalid '%s': %lld is not a token id of this model (below "
                                       "%u).",
                                       param, (long long)v, lim->vocab_size);
        lp->stop_token_ids[lp->n_stop_token_ids++] = (uint32_t)v;
    }
    return DUET_OK;
}

duet_status_t duet_oai_lp_parse(const json_t *root, const duet_oai_limits_t *lim,
                                duet_oai_request_t *req, duet_oai_error_t *err)
{
    duet_oai_lp_params_t *lp = &req->lp;
    const bool chat = req->endpoint == DUET_OAI_ENDPOINT_CHAT;
    duet_status_t st;
    lp->repetition_penalty = 1.0;
    if ((st = lp_number(root, "presence_penalty", -2.0, false, 2.0, &lp->presence_penalty, err)) !=
            DUET_OK ||
        (st = lp_number(root, "frequency_penalty", -2.0, false, 2.0, &lp->frequency_penalty,
                        err)) != DUET_OK ||
        (st = lp_number(root, "repetition_penalty", 0.0, true, 100.0, &lp->repetition_penalty,
                        err)) != DUET_OK ||
        (st = lp_parse_bias(root, lim, lp, err)) != DUET_OK)
        return st;
    int64_t v = 0;
    bool present;
    if ((st = lp_int(root, "min_tokens", 0, req->max_tokens, &v, &present, err)) != DUET_OK)
        return st;
    lp->min_tokens = (uint32_t)v;
    if ((st = lp_parse_stop_ids(root, lim, lp, err)) != DUET_OK)
        return st;

    json_t *j = lp_opt(root, "logprobs");
    if (chat) {
        if (j != NULL && !json_is_boolean(j))
            return lp_bad_type(err, "logprobs", "a boolean");
        lp->logprobs = json_is_true(j);
        v = 0;
        if ((st = lp_int(root, "top_logprobs", 0, DUET_OAI_MAX_TOP_LOGPROBS, &v, &present, err)) !=
            DUET_OK)
            return st;
        if (v > 0 && !lp->logprobs) /* 0 asks for nothing: accepted alone (OpenAI) */
            return duet_oai_error_make(err, 400, NULL, "invalid_value", "top_logprobs",
                                       "Invalid 'top_logprobs': it requires 'logprobs' to be "
                                       "true.");
        lp->top_logprobs = (uint32_t)v;
    } else {
        v = 0;
        if ((st = lp_int(root, "logprobs", 0, DUET_OAI_MAX_TOP_LOGPROBS_COMPL, &v, &present,
                         err)) != DUET_OK)
            return st;
        lp->logprobs = present;
        lp->top_logprobs = (uint32_t)v;
        json_t *e = lp_opt(root, "echo");
        if (e != NULL && !json_is_boolean(e))
            return lp_bad_type(err, "echo", "a boolean");
        lp->echo = json_is_true(e);
    }
    return DUET_OK;
}

void duet_oai_lp_params_free(duet_oai_lp_params_t *p)
{
    free(p->bias_ids);
    free(p->bias);
    memset(p, 0, sizeof(*p));
}

/* ---------------------------------------------------------------- recording */

struct duet_oai_lp {
    const duet_tokenizer_t *tok;
    bool chat, skip_special;
    int n_top; /* asked for (completions: also the chosen one when not among them) */
    duet_oai_lp_entry_t *gen;
    size_t n_gen, cap_gen;
    duet_oai_lp_entry_t *prompt; /* [n_prompt]; prompt[0] has no logprob */
    size_t n_prompt;
};

duet_status_t duet_oai_lp_create(const duet_tokenizer_t *tok, const duet_oai_request_t *req,
                                 duet_oai_lp_t **lp_p)
{
    duet_oai_lp_t *lp = calloc(1, sizeof(*lp));
    if (lp == NULL)
        return DUET_ERR_NOMEM;
    lp->tok = tok;
    lp->chat = req->endpoint == DUET_OAI_ENDPOINT_CHAT;
    lp->skip_special = req->skip_special_tokens;
    lp->n_top = (int)req->lp.top_logprobs;
    *lp_p = lp;
    return DUET_OK;
}

void duet_oai_lp_destroy(duet_oai_lp_t *lp)
{
    if (lp == NULL)
        return;
    free(lp->gen);
    free(lp->prompt);
    free(lp);
}

duet_status_t duet_oai_lp_add(duet_oai_lp_t *lp, const duet_oai_lp_entry_t *e, size_t n)
{
    if (lp->n_gen + n > lp->cap_gen) {
        size_t ncap = lp->cap_gen ? lp->cap_gen * 2 : 16;
        while (ncap < lp->n_gen + n)
            ncap *= 2;
        duet_oai_lp_entry_t *g = realloc(lp->gen, ncap * sizeof(*g));
        if (g == NULL)
            return DUET_ERR_NOMEM;
        lp->gen = g;
        lp->cap_gen = ncap;
    }
    memcpy(lp->gen + lp->n_gen, e, n * sizeof(*e));
    lp->n_gen += n;
    return DUET_OK;
}

duet_status_t duet_oai_lp_set_prompt(duet_oai_lp_t *lp, const uint32_t *ids, size_t n,
                                     const duet_oai_lp_entry_t *e)
{
    free(lp->prompt);
    lp->n_prompt = 0;
    lp->prompt = calloc(n > 0 ? n : 1, sizeof(*lp->prompt));
    if (lp->prompt == NULL)
        return DUET_ERR_NOMEM;
    for (size_t i = 0; i < n; i++) {
        if (i > 0 && e != NULL)
            lp->prompt[i] = e[i - 1];
        lp->prompt[i].id = ids[i];
    }
    lp->n_prompt = n;
    return DUET_OK;
}

size_t duet_oai_lp_count(const duet_oai_lp_t *lp)
{
    return lp->n_gen;
}

double duet_oai_lp_mean(const duet_oai_lp_t *lp, size_t n)
{
    double sum = 0;
    n = n < lp->n_gen ? n : lp->n_gen;
    for (size_t i = 0; i < n; i++)
        sum += lp->gen[i].logprob;
    return n > 0 ? sum / (double)n : 0.0;
}

/* ---------------------------------------------------------------- serialising */

/* The bytes a token adds to the text (text_offset): none for a special token the tokenizer
 * skips, else its piece. */
static size_t lp_text_len(const duet_oai_lp_t *lp, uint32_t id)
{
    const uint8_t *p;
    size_t len;
    if (lp->skip_special && duet_tokenizer_is_skipped(lp->tok, id))
        return 0;
    if (duet_tokenizer_token_bytes(lp->tok, id, &p, &len) != DUET_OK)
        return 0;
    return len;
}

/* A token's piece ("" for an id the tokenizer lacks). */
static void lp_piece(const duet_oai_lp_t *lp, uint32_t id, const uint8_t **p, size_t *len)
{
    if (duet_tokenizer_token_bytes(lp->tok, id, p, len) != DUET_OK) {
        *p = (const uint8_t *)"";
        *len = 0;
    }
}

static void lp_token_string(duet_strbuf_t *out, const duet_oai_lp_t *lp, uint32_t id)
{
    const uint8_t *p;
    size_t len;
    lp_piece(lp, id, &p, &len);
    duet_oai_json_string(out, (const char *)p, len);
}

/* A float as JSON: finite with 9 significant digits (float's round trip), -inf as -9999.0 as
 * vLLM writes it (JSON has no infinity). */
static void lp_number_json(duet_strbuf_t *out, float x)
{
    if (isfinite(x)) {
        char num[32];
        snprintf(num, sizeof(num), "%.9g", (double)x);
        /* always a JSON float: "-1" would read back as an integer */
        duet_strbuf_puts(out, num);
        if (strpbrk(num, ".e") == NULL)
            duet_strbuf_puts(out, ".0");
    } else
        duet_strbuf_puts(out, "-9999.0");
}

/* {"token":..,"logprob":..,"bytes":[..]} without the closing brace. */
static void lp_chat_token(duet_strbuf_t *out, const duet_oai_lp_t *lp, uint32_t id, float logprob)
{
    const uint8_t *p;
    size_t len;
    lp_piece(lp, id, &p, &len);
    duet_strbuf_puts(out, "{\"token\":");
    duet_oai_json_string(out, (const char *)p, len);
    duet_strbuf_puts(out, ",\"logprob\":");
    lp_number_json(out, logprob);
    duet_strbuf_puts(out, ",\"bytes\":[");
    for (size_t i = 0; i < len; i++)
        duet_strbuf_printf(out, "%s%u", i ? "," : "", (unsigned)p[i]);
    duet_strbuf_puts(out, "]");
}

static void lp_chat(const duet_oai_lp_t *lp, size_t from, size_t to, duet_strbuf_t *out)
{
    duet_strbuf_puts(out, "{\"content\":[");
    for (size_t i = from; i < to; i++) {
        const duet_oai_lp_entry_t *e = &lp->gen[i];
        duet_strbuf_puts(out, i > from ? "," : "");
        lp_chat_token(out, lp, e->id, e->logprob);
        duet_strbuf_puts(out, ",\"top_logprobs\":[");
        for (int k = 0; k < e->n_top && k < lp->n_top; k++) {
            duet_strbuf_puts(out, k ? "," : "");
            lp_chat_token(out, lp, e->top_ids[k], e->top_lps[k]);
            duet_strbuf_puts(out, "}");
        }
        duet_strbuf_puts(out, "]}");
    }
    duet_strbuf_puts(out, "]}");
}

/* The positions a completions object lists: the prompt's (with_prompt) then gen[from..to). */
typedef struct {
    const duet_oai_lp_entry_t *e;
    bool first_prompt; /* no logprob */
} lp_pos_t;

static lp_pos_t lp_pos(const duet_oai_lp_t *lp, size_t k, size_t n_pre, size_t from)
{
    if (k < n_pre)
        return (lp_pos_t){&lp->prompt[k], k == 0};
    return (lp_pos_t){&lp->gen[from + k - n_pre], false};
}

static void lp_completions(const duet_oai_lp_t *lp, size_t from, size_t to, bool with_prompt,
                           duet_strbuf_t *out)
{
    const size_t n_pre = with_prompt ? lp->n_prompt : 0, n = n_pre + (to - from);
    /* text offsets: pieces before `from` (and the prompt's with echo) come first */
    size_t off = 0;
    for (size_t i = 0; !with_prompt && i < lp->n_prompt; i++)
        off += lp_text_len(lp, lp->prompt[i].id);
    for (size_t i = 0; i < from; i++)
        off += lp_text_len(lp, lp->gen[i].id);
    duet_strbuf_puts(out, "{\"tokens\":[");
    for (size_t k = 0; k < n; k++) {
        duet_strbuf_puts(out, k ? "," : "");
        lp_token_string(out, lp, lp_pos(lp, k, n_pre, from).e->id);
    }
    duet_strbuf_puts(out, "],\"token_logprobs\":[");
    for (size_t k = 0; k < n; k++) {
        lp_pos_t q = lp_pos(lp, k, n_pre, from);
        duet_strbuf_puts(out, k ? "," : "");
        if (q.first_prompt)
            duet_strbuf_puts(out, "null");
        else
            lp_number_json(out, q.e->logprob);
    }
    duet_strbuf_puts(out, "],\"top_logprobs\":[");
    for (size_t k = 0; k < n; k++) {
        lp_pos_t q = lp_pos(lp, k, n_pre, from);
        duet_strbuf_puts(out, k ? "," : "");
        if (q.first_prompt) {
            duet_strbuf_puts(out, "null");
            continue;
        }
        duet_strbuf_puts(out, "{");
        bool chosen = false;
        int t = 0;
        for (; t < q.e->n_top && t < lp->n_top; t++) {
            duet_strbuf_puts(out, t ? "," : "");
            lp_token_string(out, lp, q.e->top_ids[t]);
            duet_strbuf_puts(out, ":");
            lp_number_json(out, q.e->top_lps[t]);
            chosen = chosen || q.e->top_ids[t] == q.e->id;
        }
        if (!chosen) { /* the chosen token too (OpenAI: up to logprobs + 1 elements) */
            duet_strbuf_puts(out, t ? "," : "");
            lp_token_string(out, lp, q.e->id);
            duet_strbuf_puts(out, ":");
            lp_number_json(out, q.e->logprob);
        }
        duet_strbuf_puts(out, "}");
    }
    duet_strbuf_puts(out, "],\"text_offset\":[");
    for (size_t k = 0; k < n; k++) {
        duet_strbuf_printf(out, "%s%zu", k ? "," : "", off);
        off += lp_text_len(lp, lp_pos(lp, k, n_pre, from).e->id);
    }
    duet_strbuf_puts(out, "]}");
}

duet_status_t duet_oai_lp_json(const duet_oai_lp_t *lp, size_t from, size_t to, bool with_prompt,
                               duet_strbuf_t *out)
{
    if (to > lp->n_gen)
        to = lp->n_gen;
    if (from > to)
        from = to;
    if (lp->chat)
        lp_chat(lp, from, to, out);
    else
        lp_completions(lp, from, to, with_prompt, out);
    return duet_strbuf_status(out);
}
