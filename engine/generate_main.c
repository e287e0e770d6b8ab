/*
 * duet-generate: the single-process reference. Loads a checkpoint, prefills one prompt and
 * decodes, with the same engine the cluster's workers run. Every cluster path must match its
 * greedy output token for token, so its flags and its --json output are a stable interface:
 *
 *   duet-generate --model DIR (--prompt TEXT | --tokens 1,2,3) [--max-tokens N]
 *                 [--temperature T] [--top-p P] [--top-k K] [--seed S]
 *                 [--dump-logits FILE] [--json] [--no-skip-special-tokens]
 *                 [--tune [--tune-file FILE]] [--logprobs N] [--dump-step-logits FILE]
 *                 [--presence-penalty P] [--frequency-penalty F] [--repetition-penalty R]
 *                 [--min-tokens N] [--logit-bias ID:BIAS,...]
 *
 * --dump-logits writes float32 little-endian [prompt_len, vocab] logits of the prompt positions.
 * --dump-step-logits writes float32 little-endian [n_generated, vocab]: the raw logits row each
 * generated token was drawn from (the first is the prompt's last row), before any processing.
 * --logprobs N (0..20) adds "logprobs" to --json: per generated token {"id", "logprob", "top":
 * [[id, logprob], ...N]} from the raw logits (docs/architecture.md, "Sampling").
 * --json prints one object: {"tokens", "text", "prompt_tokens", "prefill_tokens_per_s",
 * "decode_tokens_per_s", "finish_reason", "steps", "draft_tokens", "accepted_tokens"}.
 * The prefill + decode loop (with --spec.method, speculative) is the engine's
 * (engine/generate.h), which the tests run as this binary does; here: flags, the tokenizer, the
 * text and the output.
 * The folder's tokenizer and stop ids come from tokenizer (duet_tokenizer_load,
 * duet_tokenizer_stop_ids), as in the router; a stop id ends the text and adds none, other
 * special tokens add theirs only with --no-skip-special-tokens.
 */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "common/log.h"
#include "common/version.h"
#include "engine/generate.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/spec.h"
#include "tokenizer/tokenizer.h"

static const char *const gen_devices[] = {"auto", "cpu", "cuda", NULL};
static const char *const gen_dtypes[] = {"auto", "f32", "bf16", NULL};

static const duet_config_key_t gen_keys[] = {
    {"model", DUET_CONFIG_STRING, NULL, "checkpoint folder (config.json + safetensors)",
     .required = true},
    {"prompt", DUET_CONFIG_STRING, NULL, "prompt text (needs a tokenizer in the model folder)",
     .min = NULL},
    {"tokens", DUET_CONFIG_STRING, NULL, "prompt as comma-separated token ids, e.g. 1,2,3",
     .min = NULL},
    {"max_tokens", DUET_CONFIG_INT, "64", "tokens to generate at most", .min = "0",
     .max = "1000000"},
    {"temperature", DUET_CONFIG_FLOAT, "0", "sampling temperature (0 = greedy)", .min = "0"},
    {"top_p", DUET_CONFIG_FLOAT, "1", "nucleus sampling mass", .min = "0", .max = "1"},
    {"top_k", DUET_CONFIG_INT, "0", "sample among the k most likely tokens (0 = all)", .min = "0"},
    {"seed", DUET_CONFIG_INT, "0", "sampling seed", .min = "0"},
    {"ignore_eos", DUET_CONFIG_BOOL, "false", "keep generating after an end-of-sequence token",
     .min = NULL},
    {"skip_special_tokens", DUET_CONFIG_BOOL, "true",
     "leave special tokens out of the text (false: print their text; stop ids never)", .min = NULL},
    {"dump_logits", DUET_CONFIG_STRING, NULL,
     "write float32 LE [prompt_len, vocab] prompt logits to this file", .min = NULL},
    {"dump_step_logits", DUET_CONFIG_STRING, NULL,
     "write float32 LE [n_generated, vocab]: the raw logits row each generated token came from",
     .min = NULL},
    {"logprobs", DUET_CONFIG_INT, "-1",
     "with --json: each generated token's log-probability and the N most likely (0..20; -1 = "
     "off)",
     .min = "-1", .max = "20"},
    {"presence_penalty", DUET_CONFIG_FLOAT, "0", "OpenAI presence penalty over generated ids",
     .min = "-2", .max = "2"},
    {"frequency_penalty", DUET_CONFIG_FLOAT, "0", "OpenAI frequency penalty over generated ids",
     .min = "-2", .max = "2"},
    {"repetition_penalty", DUET_CONFIG_FLOAT, "1",
     "vLLM repetition penalty over prompt and generated ids (1 = off)", .min = "0.01",
     .max = "100"},
    {"min_tokens", DUET_CONFIG_INT, "0", "stop ids cannot end the output before this many tokens",
     .min = "0", .max = "1000000"},
    {"logit_bias", DUET_CONFIG_STRING, NULL,
     "ID:BIAS,... added to those ids' logits (bias in [-100, 100])", .min = NULL},
    {"json", DUET_CONFIG_BOOL, "false", "print one JSON object instead of streaming text",
     .min = NULL},
    {"threads", DUET_CONFIG_INT, "0", "CPU threads (0 = all cores)", .min = "0", .max = "1024"},
    {"prefill_chunk", DUET_CONFIG_INT, "512", "prompt tokens per forward call", .min = "1",
     .max = "65536"},
    {"page_tokens", DUET_CONFIG_INT, "128", "MLA KV cache page size in tokens", .min = "1",
     .max = "65536"},
    {"device", DUET_CONFIG_ENUM, "auto",
     "where the model runs: auto (cuda when a GPU is "
     "visible), cpu or cuda",
     .choices = gen_devices},
    {"dtype", DUET_CONFIG_ENUM, "auto", DUET_MODEL_DTYPE_HELP, .choices = gen_dtypes},
    {"tune", DUET_CONFIG_BOOL, "false",
     "at load, profile the kernels' tactics and keep the fastest per shape (costs load time; "
     "cpu: the matmul's work split, same output; cuda: cuBLASLt's GEMM algorithm, output equal "
     "to fp32 summation order)",
     .min = NULL},
    {"tune_file", DUET_CONFIG_STRING, NULL,
     "with --tune: load the tuned table from this file if it exists, else save it there",
     .min = NULL},
    DUET_SPEC_CONFIG_KEYS,
    DUET_LOG_CONFIG_KEYS,
};

/* Where the run's output goes: the text of the generated tokens (streamed to stdout, or kept
 * for --json) and the prompt logits (--dump-logits). */
typedef struct {
    int as_json;
    duet_detok_t *detok; /* NULL without a tokenizer */
    char *text;
    size_t text_len, text_cap;
    FILE *dump;
    const char *dump_path;
    int64_t vocab;
    FILE *step_dump; /* --dump-step-logits */
    const char *step_dump_path;
    int n_top;        /* --logprobs, -1 = off */
    json_t *logprobs; /* with --logprobs: the array of --json */
} gen_out_t;

/* duet_generate_opts_t.on_token: a generated token's text (a stop id never comes here). */
static duet_status_t gen_on_token(void *user, int32_t t)
{
    gen_out_t *e = user;
    if (e->detok == NULL)
        return DUET_OK;
    const char *piece;
    size_t plen;
    if (duet_detok_feed(e->detok, (uint32_t)t, &piece, &plen) != DUET_OK || plen == 0)
        return DUET_OK;
    if (!e->as_json) {
        fwrite(piece, 1, plen, stdout);
        fflush(stdout);
        return DUET_OK;
    }
    if (e->text_len + plen + 1 > e->text_cap) {
        size_t ncap = (e->text_len + plen + 1) * 2;
        char *grown = realloc(e->text, ncap);
        if (grown == NULL)
            return duet_error_set(DUET_ERR_NOMEM, "out of memory");
        e->text = grown;
        e->text_cap = ncap;
    }
    memcpy(e->text + e->text_len, piece, plen);
    e->text_len += plen;
    return DUET_OK;
}

/* duet_generate_opts_t.on_prefill_logits: --dump-logits. */
static duet_status_t gen_on_prefill_logits(void *user, const float *logits, int64_t n_rows)
{
    gen_out_t *e = user;
    const size_t n = (size_t)(n_rows * e->vocab);
    if (fwrite(logits, sizeof(float), n, e->dump) != n)
        return duet_error_set(DUET_ERR_IO, "writing %s: %s", e->dump_path, strerror(errno));
    return DUET_OK;
}

/* duet_generate_opts_t.on_step_logits: --dump-step-logits and --logprobs. */
static duet_status_t gen_on_step_logits(void *user, const float *logits, int32_t t)
{
    gen_out_t *e = user;
    if (e->step_dump != NULL &&
        fwrite(logits, sizeof(float), (size_t)e->vocab, e->step_dump) != (size_t)e->vocab)
        return duet_error_set(DUET_ERR_IO, "writing %s: %s", e->step_dump_path, strerror(errno));
    if (e->logprobs == NULL)
        return DUET_OK;
    float lp, top_lps[DUET_MAX_TOP_LOGPROBS];
    int32_t top_ids[DUET_MAX_TOP_LOGPROBS];
    duet_logprobs(logits, e->vocab, t, e->n_top, &lp, top_ids, top_lps);
    json_t *o = json_object(), *top = json_array();
    for (int i = 0; i < e->n_top && i < e->vocab; i++)
        json_array_append_new(top, json_pack("[if]", top_ids[i], (double)top_lps[i]));
    json_object_set_new(o, "id", json_integer(t));
    json_object_set_new(o, "logprob", json_real((double)lp));
    json_object_set_new(o, "top", top);
    json_array_append_new(e->logprobs, o);
    return DUET_OK;
}

/* Parse --logit-bias "ID:BIAS,..." into a malloc'd array (ids below vocab, bias in [-100, 100]). */
static duet_status_t gen_parse_bias(const char *s, int64_t vocab, duet_logit_bias_t **b_p,
                                    size_t *n_p)
{
    size_t cap = 1;
    for (const char *c = s; *c; c++)
        cap += *c == ',';
    duet_logit_bias_t *b = malloc(sizeof(*b) * cap);
    if (b == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "out of memory");
    size_t n = 0;
    const char *p = s;
    while (*p != '\0') {
        char *end;
        errno = 0;
        long id = strtol(p, &end, 10);
        if (end == p || *end != ':' || errno != 0 || id < 0 || id >= vocab) {
            free(b);
            return duet_error_set(DUET_ERR_INVALID,
                                  "--logit-bias: expected ID:BIAS with ID in [0, %lld) at "
                                  "\"%.20s\"",
                                  (long long)vocab, p);
        }
        p = end + 1;
        double v = strtod(p, &end);
        if (end == p || !(v >= -100.0 && v <= 100.0)) {
            free(b);
            return duet_error_set(DUET_ERR_INVALID,
                                  "--logit-bias: bias must be in [-100, 100] at \"%.20s\"", p);
        }
        b[n++] = (duet_logit_bias_t){.id = (int32_t)id, .bias = (float)v};
        p = end;
        if (*p == ',')
            p++;
        else if (*p != '\0') {
            free(b);
            return duet_error_set(DUET_ERR_INVALID, "--logit-bias: expected ',' at \"%.20s\"", p);
        }
    }
    *b_p = b;
    *n_p = n;
    return DUET_OK;
}

/* Parse "1,2,3" into a malloc'd array. */
static duet_status_t gen_parse_tokens(const char *s, int32_t **ids_p, int64_t *n_p)
{
    int64_t cap = 16, n = 0;
    int32_t *ids = malloc(sizeof(*ids) * (size_t)cap);
    if (ids == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "out of memory");
    const char *p = s;
    while (*p != '\0') {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno != 0 || v < 0 || v > INT32_MAX) {
            free(ids);
            return duet_error_set(DUET_ERR_INVALID, "--tokens: bad token id at \"%.20s\"", p);
        }
        if (n == cap) {
            cap *= 2;
            int32_t *grown = realloc(ids, sizeof(*ids) * (size_t)cap);
            if (grown == NULL) {
                free(ids);
                return duet_error_set(DUET_ERR_NOMEM, "out of memory");
            }
            ids = grown;
        }
        ids[n++] = (int32_t)v;
        p = end;
        while (*p == ' ')
            p++;
        if (*p == ',')
            p++;
        else if (*p != '\0') {
            free(ids);
            return duet_error_set(DUET_ERR_INVALID, "--tokens: expected ',' at \"%.20s\"", p);
        }
    }
    if (n == 0) {
        free(ids);
        return duet_error_set(DUET_ERR_INVALID, "--tokens: no token ids");
    }
    *ids_p = ids;
    *n_p = n;
    return DUET_OK;
}

int main(int argc, char **argv)
{
    duet_config_t *cfg = NULL;
    duet_model_t *model = NULL;
    duet_tokenizer_t *tok = NULL;
    duet_spec_t *spec = NULL;
    int32_t *prompt = NULL;
    duet_logit_bias_t *bias = NULL;
    size_t n_bias = 0;
    gen_out_t gout = {0};
    duet_generate_result_t res = {0};
    int rc = 1, n_pos = 0;
    duet_status_t st;

    if (duet_config_create(gen_keys, sizeof(gen_keys) / sizeof(gen_keys[0]), &cfg) != DUET_OK)
        return 1;
    st = duet_config_load_all(cfg, argc, argv, &n_pos);
    if (st == DUET_OK && duet_config_help_requested(cfg)) {
        char *help = NULL;
        if (duet_config_help(cfg,
                             "duet-generate --model DIR (--prompt TEXT | --tokens 1,2,3) "
                             "[options]",
                             &help) == DUET_OK)
            fputs(help, stdout);
        free(help);
        duet_config_destroy(cfg);
        return 0;
    }
    if (st == DUET_OK && duet_config_version_requested(cfg)) {
        duet_version_print("duet-generate");
        duet_config_destroy(cfg);
        return 0;
    }
    if (st == DUET_OK)
        st = duet_config_check_required(cfg);
    if (st == DUET_OK)
        duet_log_configure(cfg);
    if (st == DUET_OK && n_pos > 0)
        st = duet_error_set(DUET_ERR_INVALID, "unexpected argument \"%s\" (see --help)", argv[1]);
    const char *prompt_text = duet_config_get_string(cfg, "prompt");
    const char *tokens_text = duet_config_get_string(cfg, "tokens");
    if (st == DUET_OK && (prompt_text == NULL) == (tokens_text == NULL))
        st = duet_error_set(DUET_ERR_INVALID, "give exactly one of --prompt and --tokens");
    if (st != DUET_OK) {
        fprintf(stderr, "duet-generate: %s\n", duet_error_last());
        goto out;
    }

    const char *dir = duet_config_get_string(cfg, "model");
    const int64_t max_new = duet_config_get_int(cfg, "max_tokens");
    const int as_json = duet_config_get_bool(cfg, "json");
    const int ignore_eos = duet_config_get_bool(cfg, "ignore_eos");
    const char *dump_path = duet_config_get_string(cfg, "dump_logits");
    duet_sampling_t sp;
    duet_sampling_default(&sp);
    sp.temperature = (float)duet_config_get_float(cfg, "temperature");
    sp.top_p = (float)duet_config_get_float(cfg, "top_p");
    sp.top_k = duet_config_get_int(cfg, "top_k");
    sp.seed = (uint64_t)duet_config_get_int(cfg, "seed");
    if ((st = duet_sampling_validate(&sp)) != DUET_OK) {
        fprintf(stderr, "duet-generate: %s\n", duet_error_last());
        goto out;
    }
    duet_spec_opts_t so;
    if ((st = duet_spec_opts_from_config(cfg, &so)) != DUET_OK) {
        fprintf(stderr, "duet-generate: %s\n", duet_error_last());
        goto out;
    }

    /* tokenizer: required for --prompt, optional (for text output) with --tokens */
    st = duet_tokenizer_load(dir, &tok);
    if (st != DUET_OK && (prompt_text != NULL || st != DUET_ERR_NOT_FOUND)) {
        fprintf(stderr, "duet-generate: %s%s\n", duet_error_last(),
                st == DUET_ERR_NOT_FOUND ? ": pass the prompt as --tokens" : "");
        goto out;
    }
    /* the ids that stop: config.json's and generation_config.json's eos_token_id and the
     * tokenizer's eos token, as the router sends them to the workers */
    uint32_t stop_ids[16];
    size_t n_stop = 0;
    if ((st = duet_tokenizer_stop_ids(dir, tok, stop_ids, 16, &n_stop)) != DUET_OK) {
        fprintf(stderr, "duet-generate: %s\n", duet_error_last());
        goto out;
    }
    int64_t n_prompt = 0;
    if (tokens_text != NULL) {
        if ((st = gen_parse_tokens(tokens_text, &prompt, &n_prompt)) != DUET_OK) {
            fprintf(stderr, "duet-generate: %s\n", duet_error_last());
            goto out;
        }
    } else {
        size_t n = 0;
        st = duet_tokenizer_encode(tok, prompt_text, strlen(prompt_text), 0, NULL, 0, &n);
        if (st != DUET_OK && st != DUET_ERR_NO_SPACE) {
            fprintf(stderr, "duet-generate: %s\n", duet_error_last());
            goto out;
        }
        uint32_t *ids = malloc(sizeof(*ids) * (n + 1));
        prompt = malloc(sizeof(*prompt) * (n + 2));
        if (ids == NULL || prompt == NULL ||
            duet_tokenizer_encode(tok, prompt_text, strlen(prompt_text), 0, ids, n, &n) !=
                DUET_OK) {
            free(ids);
            fprintf(stderr, "duet-generate: cannot tokenize the prompt: %s\n", duet_error_last());
            goto out;
        }
        /* the id a text prompt starts with: the router's /v1/completions asks the same */
        int32_t bos = -1;
        if (duet_tokenizer_prompt_bos(dir, tok, &bos) != DUET_OK) {
            free(ids);
            fprintf(stderr, "duet-generate: %s\n", duet_error_last());
            goto out;
        }
        if (bos >= 0)
            prompt[n_prompt++] = bos;
        for (size_t i = 0; i < n; i++)
            prompt[n_prompt++] = (int32_t)ids[i];
        free(ids);
        if (n_prompt == 0) {
            fprintf(stderr, "duet-generate: the prompt is empty\n");
            goto out;
        }
    }

    duet_model_opts_t opts;
    duet_model_opts_default(&opts);
    opts.n_threads = (int)duet_config_get_int(cfg, "threads");
    opts.max_batch_tokens = duet_config_get_int(cfg, "prefill_chunk");
    opts.page_tokens = duet_config_get_int(cfg, "page_tokens");
    opts.max_seqs = 1;
    opts.max_seq_len = n_prompt + max_new;
    opts.spec_rows = duet_spec_target_rows(&so);
    opts.tune = duet_config_get_bool(cfg, "tune");
    opts.tune_file = duet_config_get_string(cfg, "tune_file");
    if ((st = duet_model_dtype_parse(duet_config_get_enum(cfg, "dtype"), &opts.dtype)) != DUET_OK) {
        fprintf(stderr, "duet-generate: %s\n", duet_error_last());
        goto out;
    }
    if ((st = duet_model_device_parse(duet_config_get_enum(cfg, "device"), &opts.device)) !=
        DUET_OK) {
        fprintf(stderr, "duet-generate: %s\n", duet_error_last());
        goto out;
    }
    if ((st = duet_model_load(dir, &opts, &model)) != DUET_OK) {
        fprintf(stderr, "duet-generate: cannot load %s: %s\n", dir, duet_error_last());
        goto out;
    }
    if (so.method != DUET_SPEC_NONE && (st = duet_spec_create(&so, model, &spec)) != DUET_OK) {
        fprintf(stderr, "duet-generate: %s\n", duet_error_last());
        goto out;
    }
    res.tokens = malloc(sizeof(int32_t) * (size_t)(max_new > 0 ? max_new : 1));
    if (res.tokens == NULL) {
        fprintf(stderr, "duet-generate: out of memory\n");
        goto out;
    }
    if (dump_path != NULL && (gout.dump = fopen(dump_path, "wb")) == NULL) {
        fprintf(stderr, "duet-generate: cannot write %s: %s\n", dump_path, strerror(errno));
        goto out;
    }
    gout.step_dump_path = duet_config_get_string(cfg, "dump_step_logits");
    if (gout.step_dump_path != NULL &&
        (gout.step_dump = fopen(gout.step_dump_path, "wb")) == NULL) {
        fprintf(stderr, "duet-generate: cannot write %s: %s\n", gout.step_dump_path,
                strerror(errno));
        goto out;
    }
    gout.n_top = (int)duet_config_get_int(cfg, "logprobs");
    if (gout.n_top >= 0 && (gout.logprobs = json_array()) == NULL)
        goto out;
    const char *bias_text = duet_config_get_string(cfg, "logit_bias");
    if (bias_text != NULL && gen_parse_bias(bias_text, duet_model_config(model)->vocab_size, &bias,
                                            &n_bias) != DUET_OK) {
        fprintf(stderr, "duet-generate: %s\n", duet_error_last());
        goto out;
    }
    const unsigned detok_flags =
        duet_config_get_bool(cfg, "skip_special_tokens") ? DUET_DETOK_SKIP_SPECIAL : 0;
    if (tok != NULL && duet_detok_create(tok, detok_flags, &gout.detok) != DUET_OK) {
        fprintf(stderr, "duet-generate: %s\n", duet_error_last());
        goto out;
    }
    gout.as_json = as_json;
    gout.dump_path = dump_path;
    gout.vocab = duet_model_config(model)->vocab_size;

    /* prefill in chunks and decode: the engine's loop (engine/generate.h) */
    duet_generate_opts_t go;
    duet_generate_opts_default(&go);
    go.sampling = sp;
    go.max_tokens = max_new;
    go.stop_ids = stop_ids;
    go.n_stop = n_stop;
    go.ignore_eos = ignore_eos;
    go.spec = spec;
    go.prefill_chunk = opts.max_batch_tokens;
    go.on_prefill_logits = gout.dump != NULL ? gen_on_prefill_logits : NULL;
    go.on_token = gen_on_token;
    go.proc.presence_penalty = (float)duet_config_get_float(cfg, "presence_penalty");
    go.proc.frequency_penalty = (float)duet_config_get_float(cfg, "frequency_penalty");
    go.proc.repetition_penalty = (float)duet_config_get_float(cfg, "repetition_penalty");
    go.proc.min_tokens = duet_config_get_int(cfg, "min_tokens");
    go.proc.bias = bias;
    go.proc.n_bias = n_bias;
    go.on_step_logits = gout.step_dump != NULL || gout.logprobs != NULL ? gen_on_step_logits : NULL;
    go.user = &gout;
    if ((st = duet_generate_run(model, prompt, n_prompt, &go, &res)) != DUET_OK) {
        fprintf(stderr, "duet-generate: %s\n", duet_error_last());
        goto out;
    }
    const char *finish = res.stopped ? "stop" : "length";
    if (gout.detok != NULL) {
        const char *piece;
        size_t plen;
        if (duet_detok_flush(gout.detok, &piece, &plen) == DUET_OK && plen > 0) {
            if (as_json) {
                char *grown = realloc(gout.text, gout.text_len + plen + 1);
                if (grown == NULL)
                    goto out;
                gout.text = grown;
                memcpy(gout.text + gout.text_len, piece, plen);
                gout.text_len += plen;
            } else {
                fwrite(piece, 1, plen, stdout);
            }
        }
    }

    const double t_prefill = res.prefill_s, t_decode = res.decode_s;
    double prefill_tps = t_prefill > 0 ? (double)n_prompt / t_prefill : 0.0;
    /* the first generated token comes from the prefill's logits: n_out - 1 decode steps */
    const int64_t n_out = res.n_tokens;
    double decode_tps = (n_out > 1 && t_decode > 0) ? (double)(n_out - 1) / t_decode : 0.0;
    if (as_json) {
        json_t *o = json_object();
        json_t *ta = json_array();
        for (int64_t i = 0; i < n_out; i++)
            json_array_append_new(ta, json_integer(res.tokens[i]));
        json_object_set_new(o, "tokens", ta);
        json_object_set_new(o, "text",
                            json_stringn(gout.text != NULL ? gout.text : "", gout.text_len));
        json_object_set_new(o, "prompt_tokens", json_integer(n_prompt));
        json_object_set_new(o, "prefill_tokens_per_s", json_real(prefill_tps));
        json_object_set_new(o, "decode_tokens_per_s", json_real(decode_tps));
        json_object_set_new(o, "finish_reason", json_string(finish));
        /* decode forwards after the prefill, and what speculation drafted and kept in them */
        json_object_set_new(o, "steps", json_integer(res.steps));
        json_object_set_new(o, "draft_tokens", json_integer((json_int_t)res.draft_tokens));
        json_object_set_new(o, "accepted_tokens", json_integer((json_int_t)res.accepted_tokens));
        if (gout.logprobs != NULL) {
            json_object_set_new(o, "logprobs", gout.logprobs);
            gout.logprobs = NULL;
        }
        char *s = json_dumps(o, JSON_COMPACT | JSON_ENSURE_ASCII);
        if (s != NULL)
            puts(s);
        free(s);
        json_decref(o);
    } else {
        if (tok == NULL) {
            for (int64_t i = 0; i < n_out; i++)
                printf("%s%d", i ? "," : "", res.tokens[i]);
        }
        printf("\n");
        fprintf(stderr,
                "duet-generate: %lld prompt tokens at %.1f tok/s, %lld generated at %.1f "
                "tok/s (%s)\n",
                (long long)n_prompt, prefill_tps, (long long)n_out, decode_tps, finish);
    }
    rc = 0;

out:
    if (gout.dump != NULL && fclose(gout.dump) != 0 && rc == 0) {
        fprintf(stderr, "duet-generate: closing %s: %s\n", dump_path, strerror(errno));
        rc = 1;
    }
    if (gout.step_dump != NULL && fclose(gout.step_dump) != 0 && rc == 0) {
        fprintf(stderr, "duet-generate: closing %s: %s\n", gout.step_dump_path, strerror(errno));
        rc = 1;
    }
    json_decref(gout.logprobs);
    free(bias);
    duet_spec_destroy(spec);
    free(gout.text);
    free(res.tokens);
    free(prompt);
    duet_detok_destroy(gout.detok);
    duet_tokenizer_destroy(tok);
    duet_model_free(model);
    duet_config_destroy(cfg);
    return rc;
}
