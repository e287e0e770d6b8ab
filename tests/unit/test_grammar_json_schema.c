/*
 * response_format json_schema's compiler and automaton (grammar/json_schema.h): schemas outside
 * the subset refused with the keyword and place named; texts valid against a schema accepted,
 * each kind of invalid one refused; random walks through the automaton parse (jansson) whenever
 * it says complete; the trie mask equal to feeding every token on its own. The Python jsonschema
 * package checks the walks against the schemas in tests/integration/json_schema_oracle_test.py.
 */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/json_schema.h"

static duet_jschema_t *compile_ok(const char *schema)
{
    duet_jschema_t *s = NULL;
    duet_status_t st = duet_jschema_compile(schema, strlen(schema), &s);
    cr_assert_eq(st, DUET_OK, "%s: %s", schema, duet_error_last());
    return s;
}

/* 1 when all of text is accepted and complete; 0 when a byte is refused or it is incomplete. */
static int accepts(const duet_jschema_t *s, const char *text)
{
    duet_jschema_state_t st;
    duet_jschema_start(s, &st);
    return duet_jschema_feed_n(s, &st, (const uint8_t *)text, strlen(text)) &&
           duet_jschema_accepting(s, &st);
}

Test(json_schema, refuses_what_it_cannot_guarantee)
{
    static const struct {
        const char *schema, *needle;
    } bad[] = {
        {"{\"type\":\"string\",\"pattern\":\"^a\"}", "'pattern'"},
        {"{\"type\":\"string\",\"minLength\":3}", "'minLength'"},
        {"{\"type\":\"string\",\"format\":\"date-time\"}", "'format'"},
        {"{\"type\":\"number\",\"minimum\":0}", "'minimum'"},
        {"{\"allOf\":[{\"type\":\"string\"}]}", "'allOf'"},
        {"{\"properties\":{\"a\":{\"type\":\"integer\",\"multipleOf\":2}}}",
         "#/properties/a: keyword 'multipleOf'"},
        {"{\"type\":\"object\",\"required\":[\"x\"],\"properties\":{\"a\":true}}", "required"},
        {"{\"type\":\"object\",\"required\":[\"x\"]}", "required"},
        {"{\"$ref\":\"#/$defs/missing\"}", "not in the schema"},
        {"{\"$ref\":\"http://example.com/s.json\"}", "$ref must be"},
        {"{\"anyOf\":[{\"type\":\"string\"},{\"enum\":[\"a\"]}]}", "start alike"},
        {"{\"anyOf\":[{\"type\":\"integer\"},{\"type\":\"number\"}]}", "start alike"},
        {"{\"anyOf\":[true,{\"type\":\"null\"}]}", "start alike"},
        {"{\"type\":\"string\",\"anyOf\":[{\"type\":\"string\"}]}", "only with annotations"},
        {"{\"type\":\"colour\"}", "type must be"},
        {"{\"type\":[]}", "type must be"},
        {"{\"type\":\"integer\",\"enum\":[\"a\",1.5]}", "no enum"},
        {"{\"type\":\"array\",\"minItems\":3,\"maxItems\":2}", "below minItems"},
        {"{\"type\":\"array\",\"items\":[{\"type\":\"string\"}]}", "tuple"},
        {"false", "accepts no value"},
        {"[1]", "must be an object or a boolean"},
        {"{\"$defs\":{\"a\":{\"$ref\":\"#/$defs/b\"},\"b\":{\"$ref\":\"#/$defs/a\"}},"
         "\"$ref\":\"#/$defs/a\"}",
         "never reaches"},
        {"{\"type\":", "invalid JSON"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        duet_jschema_t *s = (duet_jschema_t *)0x1;
        duet_error_clear();
        duet_status_t st = duet_jschema_compile(bad[i].schema, strlen(bad[i].schema), &s);
        cr_expect_eq(st, DUET_ERR_INVALID, "%s compiled", bad[i].schema);
        cr_expect_eq(s, (duet_jschema_t *)0x1, "%s: s_p written on failure", bad[i].schema);
        cr_expect_not_null(strstr(duet_error_last(), bad[i].needle), "%s: \"%s\" lacks \"%s\"",
                           bad[i].schema, duet_error_last(), bad[i].needle);
    }
}

Test(json_schema, object_properties_in_order_required_enforced)
{
    duet_jschema_t *s =
        compile_ok("{\"title\":\"T\",\"type\":\"object\",\"properties\":{"
                   "\"name\":{\"type\":\"string\",\"description\":\"d\"},"
                   "\"age\":{\"type\":\"integer\"},"
                   "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"maxItems\":2},"
                   "\"ok\":{\"type\":\"boolean\"}},"
                   "\"required\":[\"name\",\"ok\"],\"additionalProperties\":false}");
    static const char *const good[] = {
        "{\"name\":\"x\",\"ok\":true}",
        "{\"name\":\"\",\"age\":-3,\"ok\":false}",
        "{ \"name\" : \"a\\u00e9\" ,\n \"tags\" : [ ] , \"ok\" : true }",
        "{\"name\":\"x\",\"age\":0,\"tags\":[\"a\",\"b\"],\"ok\":true}",
    };
    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++)
        cr_expect(accepts(s, good[i]), "refused %s", good[i]);
    static const char *const badt[] = {
        "{}",                                                        /* required missing */
        "{\"name\":\"x\"}",                                          /* ok missing */
        "{\"ok\":true,\"name\":\"x\"}",                              /* out of order */
        "{\"name\":\"x\",\"extra\":1,\"ok\":true}",                  /* not a property */
        "{\"name\":1,\"ok\":true}",                                  /* wrong type */
        "{\"name\":\"x\",\"age\":1.5,\"ok\":true}",                  /* integer */
        "{\"name\":\"x\",\"age\":1e3,\"ok\":true}",                  /* integer */
        "{\"name\":\"x\",\"tags\":[\"a\",\"b\",\"c\"],\"ok\":true}", /* maxItems */
        "{\"name\":\"x\",\"ok\":true} ",                             /* nothing after the value */
        " {\"name\":\"x\",\"ok\":true}",                             /* nor before */
        "{\"name\":\"x\",\"name\":\"y\",\"ok\":true}",               /* twice */
        "{\"name\":\"x\",\"ok\":true,}",
    };
    for (size_t i = 0; i < sizeof(badt) / sizeof(badt[0]); i++)
        cr_expect(!accepts(s, badt[i]), "accepted %s", badt[i]);
    duet_jschema_free(s);
}

Test(json_schema, types_unions_enums_refs)
{
    struct {
        const char *schema;
        const char *good[6];
        const char *bad[6];
    } cases[] = {
        {"{\"type\":[\"string\",\"null\"]}", {"\"a\"", "null"}, {"1", "true", "nul", "[]"}},
        {"{\"anyOf\":[{\"type\":\"integer\"},{\"type\":\"null\"},{\"type\":\"array\","
         "\"items\":{\"type\":\"boolean\"},\"minItems\":1}]}",
         {"-12", "null", "[true]", "[true,false]"},
         {"1.5", "[]", "[1]", "\"x\""}},
        {"{\"enum\":[\"red\",\"green\",1,12,null,{\"a\":[1]}]}",
         {"\"red\"", "\"green\"", "1", "12", "null", "{\"a\":[1]}"},
         {"\"re\"", "\"blue\"", "123", "2", "{\"a\": [1]}", "true"}},
        {"{\"const\":\"fixed\"}", {"\"fixed\""}, {"\"fixe\"", "\"fixed2\"", "1"}},
        {"{\"type\":\"object\"}", {"{}", "{\"any\":[1,{\"x\":null}]}"}, {"[]", "1", "{"}},
        {"{\"type\":\"object\",\"additionalProperties\":false}", {"{}", "{ }"}, {"{\"a\":1}"}},
        {"true", {"1", "\"s\"", "[1,[2]]", "{\"a\":{}}", "null"}, {"", "{", "1 "}},
        {"{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":"
         "\"integer\"},\"next\":{\"anyOf\":[{\"$ref\":\"#/$defs/node\"},{\"type\":\"null\"}]}},"
         "\"required\":[\"v\",\"next\"]}},\"$ref\":\"#/$defs/node\"}",
         {"{\"v\":1,\"next\":null}", "{\"v\":1,\"next\":{\"v\":2,\"next\":null}}"},
         {"{\"v\":1}", "{\"v\":1,\"next\":{\"v\":2}}", "{\"v\":1,\"next\":1}"}},
        {"{\"type\":\"array\",\"items\":false}", {"[]"}, {"[1]"}},
        {"{\"type\":\"number\"}", {"0", "-0.5", "1e-7", "12.25E+3"}, {"01", "1.", "+1", "NaN"}},
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        duet_jschema_t *s = compile_ok(cases[c].schema);
        for (int i = 0; i < 6 && cases[c].good[i] != NULL; i++)
            cr_expect(accepts(s, cases[c].good[i]), "%s refused %s", cases[c].schema,
                      cases[c].good[i]);
        for (int i = 0; i < 6 && cases[c].bad[i] != NULL; i++)
            cr_expect(!accepts(s, cases[c].bad[i]), "%s accepted %s", cases[c].schema,
                      cases[c].bad[i]);
        duet_jschema_free(s);
    }
}

/* A made-up vocabulary: the mask through the trie equals feeding each token alone, and random
 * walks under the mask never dead-end and parse when complete. */
static const char *const VOCAB[] = {
    "{",   "}",    "[",     "]",    "\"",  ":",       ",",      " ",     "{\"",  "\":",
    "\",", "true", "false", "null", "0",   "1",       "12",     "-",     ".",    "e",
    "a",   "\\n",  "\"}",   "}}",   "1,",  "é",       "\"name", "\"age", "age",  "\"ok\":",
    "ok",  "\"v",  "v\":",  "next", "red", "\"red\"", "green",  "<|s|>", "tags", "\":[",
};
#define N_MULTI ((int64_t)(sizeof(VOCAB) / sizeof(VOCAB[0])))
#define NV      (N_MULTI + 95) /* and every printable ASCII byte alone, as real vocabularies have */
static char g_single[95][2];

static const char *tok(int64_t id)
{
    if (id < N_MULTI)
        return VOCAB[id];
    g_single[id - N_MULTI][0] = (char)(0x20 + id - N_MULTI);
    return g_single[id - N_MULTI];
}

static int vocab_bytes(void *user, uint32_t id, const uint8_t **p, size_t *n)
{
    (void)user;
    *p = (const uint8_t *)tok(id);
    *n = strlen(tok(id));
    return 0;
}

static int vocab_special(void *user, uint32_t id)
{
    (void)user;
    return id < N_MULTI && VOCAB[id][0] == '<';
}

Test(json_schema, mask_matches_per_token_feed_and_walks_parse)
{
    static const char *const schemas[] = {
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":"
        "\"integer\"},\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"red\",\"green\",1]},"
        "\"maxItems\":3},\"ok\":{\"type\":\"boolean\"}},\"required\":[\"name\",\"ok\"]}",
        "{\"$defs\":{\"n\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"number\"},"
        "\"next\":{\"anyOf\":[{\"$ref\":\"#/$defs/n\"},{\"type\":\"null\"}]}},\"required\":["
        "\"v\"]}},\"$ref\":\"#/$defs/n\"}",
        "{\"type\":[\"array\",\"string\"],\"items\":{\"type\":\"object\"},\"minItems\":2}",
    };
    duet_json_vocab_t *v;
    cr_assert_eq(duet_json_vocab_create(NV, vocab_bytes, vocab_special, NULL, &v), DUET_OK);
    srand(7);
    uint8_t ok[NV];
    int complete = 0;
    for (size_t k = 0; k < sizeof(schemas) / sizeof(schemas[0]); k++) {
        duet_jschema_t *s = compile_ok(schemas[k]);
        for (int walk = 0; walk < 200; walk++) {
            duet_jschema_state_t st;
            duet_jschema_start(s, &st);
            char text[4096];
            size_t len = 0;
            for (int step = 0; step < 120; step++) {
                int64_t n_ok = duet_jschema_allowed(s, &st, v, ok);
                int64_t count = 0;
                for (int64_t id = 0; id < NV; id++) {
                    duet_jschema_state_t t = st;
                    size_t n = strlen(tok(id));
                    int expect = n > 0 && !vocab_special(NULL, (uint32_t)id) &&
                                 duet_jschema_feed_n(s, &t, (const uint8_t *)tok(id), n);
                    cr_assert_eq(ok[id], expect, "schema %zu, after \"%.*s\": token \"%s\"", k,
                                 (int)len, text, tok(id));
                    count += expect;
                }
                cr_assert_eq(n_ok, count);
                int done = duet_jschema_accepting(s, &st);
                cr_assert(n_ok > 0 || done, "schema %zu: dead end after \"%.*s\"", k, (int)len,
                          text);
                if (done && (n_ok == 0 || rand() % 4 == 0)) {
                    json_error_t err;
                    json_t *j = json_loadb(text, len, JSON_DECODE_ANY, &err);
                    cr_assert_not_null(j, "schema %zu: complete but \"%.*s\" does not parse", k,
                                       (int)len, text);
                    json_decref(j);
                    complete++;
                    break;
                }
                int64_t pick = rand() % n_ok;
                for (int64_t id = 0; id < NV; id++)
                    if (ok[id] && pick-- == 0) {
                        size_t n = strlen(tok(id));
                        cr_assert(duet_jschema_feed_n(s, &st, (const uint8_t *)tok(id), n));
                        memcpy(text + len, tok(id), n);
                        len += n;
                        break;
                    }
            }
        }
        duet_jschema_free(s);
    }
    cr_expect_gt(complete, 50, "only %d walks completed", complete);
    duet_json_vocab_destroy(v);
}
