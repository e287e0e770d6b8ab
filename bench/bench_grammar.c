/*
 * duet-bench-grammar: what response_format's mask costs per decode step. Builds the vocabulary
 * tries of a tokenizer (default data/tokenizers/o200k_base.tiktoken, 200,019 ids), then times
 * the mask (duet_json_allowed, duet_jschema_allowed) in the states a constrained answer passes
 * through: json_object's start, key, string and number, and json_schema's (a form with an
 * enum, an array of objects and $defs) start, key, string value, enum value and after a value.
 * Prints the trie build time and, per state, the allowed ids and the mean and worst time.
 *
 *   duet-bench-grammar [tokenizer-file [reps]]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/version.h"
#include "grammar/json_grammar.h"
#include "grammar/json_schema.h"
#include "tokenizer/tokenizer.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int tok_bytes(void *user, uint32_t id, const uint8_t **p, size_t *n)
{
    return duet_tokenizer_token_bytes(user, id, p, n) != DUET_OK;
}

static int tok_special(void *user, uint32_t id)
{
    return duet_tokenizer_is_special(user, id);
}

static const char SCHEMA[] =
    "{\"$defs\":{\"day\":{\"type\":\"object\",\"properties\":{\"day\":{\"enum\":[\"monday\","
    "\"tuesday\",\"wednesday\"]},\"high\":{\"type\":\"number\"}},\"required\":[\"day\",\"high\"]}},"
    "\"type\":\"object\",\"properties\":{\"location\":{\"type\":\"string\"},\"unit\":{\"enum\":["
    "\"celsius\",\"fahrenheit\"]},\"days\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/"
    "day\"}},"
    "\"note\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}]}},\"required\":[\"location\","
    "\"unit\",\"days\"]}";

int main(int argc, char **argv)
{
    if (argc > 1 && duet_version_flag(argv[1])) {
        duet_version_print("duet-bench-grammar");
        return 0;
    }
    if (argc > 1 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        printf("usage: duet-bench-grammar [tokenizer-file [reps]]\n"
               "Times response_format's vocabulary mask per decode step (json_object and\n"
               "json_schema, in the states an answer passes through) on a tokenizer (default\n"
               "data/tokenizers/o200k_base.tiktoken), reps times each (default 200).\n");
        return 0;
    }
    if (argc > 3 || (argc > 1 && argv[1][0] == '-')) {
        fprintf(stderr, "duet-bench-grammar: unexpected argument %s (see --help)\n",
                argc > 3 ? argv[3] : argv[1]);
        return 2;
    }
    const char *path = argc > 1 ? argv[1] : DUET_SOURCE_DIR "/data/tokenizers/o200k_base.tiktoken";
    int reps = argc > 2 ? atoi(argv[2]) : 200;
    if (reps < 1)
        reps = 1;
    duet_tokenizer_t *tok = NULL;
    if (duet_tokenizer_load(path, &tok) != DUET_OK) {
        fprintf(stderr, "duet-bench-grammar: %s\n", duet_error_last());
        return 1;
    }
    const int64_t V = duet_tokenizer_vocab_size(tok);
    double t0 = now();
    duet_json_vocab_t *v = NULL;
    if (duet_json_vocab_create(V, tok_bytes, tok_special, tok, &v) != DUET_OK) {
        fprintf(stderr, "duet-bench-grammar: %s\n", duet_error_last());
        return 1;
    }
    printf("%s: %lld ids, tries built in %.3f s; %d reps per state\n", path, (long long)V,
           now() - t0, reps);
    duet_jschema_t *s = NULL;
    if (duet_jschema_compile(SCHEMA, strlen(SCHEMA), &s) != DUET_OK) {
        fprintf(stderr, "duet-bench-grammar: %s\n", duet_error_last());
        return 1;
    }
    uint8_t *ok = malloc((size_t)V);
    static const struct {
        int schema;
        const char *name, *prefix;
    } states[] = {
        {0, "json_object start", ""},
        {0, "json_object key", "{\"na"},
        {0, "json_object string", "{\"name\":\"Ber"},
        {0, "json_object number", "{\"n\":12"},
        {1, "json_schema start", ""},
        {1, "json_schema key", "{\"loc"},
        {1, "json_schema string value", "{\"location\":\"Ber"},
        {1, "json_schema enum value", "{\"location\":\"B\",\"unit\":\"c"},
        {1, "json_schema after a value", "{\"location\":\"B\",\"unit\":\"celsius\""},
        {1, "json_schema nested number",
         "{\"location\":\"B\",\"unit\":\"celsius\",\"days\":[{"
         "\"day\":\"monday\",\"high\":1"},
    };
    printf("%-28s %10s %12s %12s\n", "state", "allowed", "mean ms", "worst ms");
    for (size_t i = 0; i < sizeof(states) / sizeof(states[0]); i++) {
        duet_json_t js;
        duet_jschema_state_t ss;
        duet_json_init(&js, 1);
        duet_jschema_start(s, &ss);
        const uint8_t *p = (const uint8_t *)states[i].prefix;
        size_t n = strlen(states[i].prefix);
        if (states[i].schema ? !duet_jschema_feed_n(s, &ss, p, n) : !duet_json_feed_n(&js, p, n)) {
            fprintf(stderr, "duet-bench-grammar: %s: prefix refused\n", states[i].name);
            return 1;
        }
        double sum = 0, worst = 0;
        int64_t allowed = 0;
        for (int r = 0; r < reps; r++) {
            double a = now();
            allowed = states[i].schema ? duet_jschema_allowed(s, &ss, v, ok)
                                       : duet_json_allowed(&js, v, ok);
            double d = now() - a;
            sum += d;
            worst = d > worst ? d : worst;
        }
        printf("%-28s %10lld %12.4f %12.4f\n", states[i].name, (long long)allowed, sum / reps * 1e3,
               worst * 1e3);
    }
    free(ok);
    duet_jschema_free(s);
    duet_json_vocab_destroy(v);
    duet_tokenizer_destroy(tok);
    return 0;
}
