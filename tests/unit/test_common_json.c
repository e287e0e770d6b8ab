/*
 * JSON helpers (common/json.h): typed getters with path-naming errors, optional fields, size cap
 * and syntax-error positions on load, and a deterministic fuzz pass over mutated documents.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/json.h"

static const char *const config_json =
    "{\n"
    "  \"num_heads\": 32,\n"
    "  \"rms_norm_eps\": 1e-5,\n"
    "  \"rope_theta\": 10000,\n"
    "  \"tie_word_embeddings\": false,\n"
    "  \"model_type\": \"kimi_linear\",\n"
    "  \"rope_scaling\": null,\n"
    "  \"linear_attn_config\": {\"kda_layers\": [1, 2, 3, \"4\"], \"head_dim\": 128,\n"
    "                          \"full_attn_layers\": [4, 8]},\n"
    "  \"experts\": [{\"id\": 0}, {\"id\": \"x\"}],\n"
    "  \"empty\": []\n"
    "}\n";

static json_t *load(const char *text)
{
    json_t *root = NULL;
    cr_assert_eq(duet_json_load_buffer(text, strlen(text), "config.json", 1 << 20, &root), DUET_OK,
                 "%s", duet_error_last());
    return root;
}

#define ASSERT_ERR(expr, want_st, needle)                                                          \
    do {                                                                                           \
        duet_status_t st_ = (expr);                                                                \
        cr_assert_eq(st_, (want_st), "status %d, detail: %s", st_, duet_error_last());             \
        cr_assert(strstr(duet_error_last(), (needle)) != NULL, "detail \"%s\" lacks \"%s\"",       \
                  duet_error_last(), (needle));                                                    \
    } while (0)

Test(common_json, typed_getters, .timeout = 10)
{
    json_t *root = load(config_json);
    int64_t i;
    double d;
    bool b;
    const char *s;
    cr_assert_eq(duet_json_get_int(root, "config.json", "num_heads", 1, 1024, &i), DUET_OK);
    cr_assert_eq(i, 32);
    cr_assert_eq(duet_json_get_double(root, "config.json", "rms_norm_eps", 0, 1, &d), DUET_OK);
    cr_assert_float_eq(d, 1e-5, 1e-12);
    cr_assert_eq(duet_json_get_double(root, "config.json", "rope_theta", 0, INFINITY, &d), DUET_OK,
                 "integers are numbers too");
    cr_assert_eq(d, 10000);
    cr_assert_eq(duet_json_get_bool(root, "config.json", "tie_word_embeddings", &b), DUET_OK);
    cr_assert_eq(b, false);
    cr_assert_eq(duet_json_get_string(root, "config.json", "model_type", &s), DUET_OK);
    cr_assert_str_eq(s, "kimi_linear");
    cr_assert_eq(duet_json_get_int(root, "config.json", "linear_attn_config.head_dim", 1, 512, &i),
                 DUET_OK);
    cr_assert_eq(i, 128);
    cr_assert_eq(duet_json_get_int(root, "config.json", "experts[0].id", 0, 10, &i), DUET_OK);
    cr_assert_eq(i, 0);
    json_t *sub;
    cr_assert_eq(duet_json_get_object(root, "config.json", "linear_attn_config", &sub), DUET_OK);
    cr_assert_eq(duet_json_get_array(root, "config.json", "experts", &sub), DUET_OK);
    cr_assert_eq(json_array_size(sub), 2);
    json_decref(root);
}

Test(common_json, int_array, .timeout = 10)
{
    json_t *root = load(config_json);
    int64_t *v = NULL;
    size_t n = 0;
    cr_assert_eq(duet_json_get_int_array(root, "config.json", "linear_attn_config.full_attn_layers",
                                         0, 100, &v, &n),
                 DUET_OK);
    cr_assert_eq(n, 2);
    cr_assert_eq(v[0], 4);
    cr_assert_eq(v[1], 8);
    free(v);
    cr_assert_eq(duet_json_get_int_array(root, "config.json", "empty", 0, 1, &v, &n), DUET_OK);
    cr_assert_eq(n, 0);
    free(v);
    ASSERT_ERR(duet_json_get_int_array(root, "config.json", "linear_attn_config.kda_layers", 0, 100,
                                       &v, &n),
               DUET_ERR_FORMAT,
               "config.json: field \"linear_attn_config.kda_layers[3]\": expected integer, got "
               "string");
    ASSERT_ERR(duet_json_get_int_array(root, "config.json", "linear_attn_config.full_attn_layers",
                                       0, 5, &v, &n),
               DUET_ERR_RANGE, "full_attn_layers[1]\": 8 is outside [0, 5]");
    ASSERT_ERR(duet_json_get_int_array(root, "config.json", "num_heads", 0, 5, &v, &n),
               DUET_ERR_FORMAT, "expected array of integers, got integer");
    json_decref(root);
}

Test(common_json, errors_name_source_and_path, .timeout = 10)
{
    json_t *root = load(config_json);
    int64_t i = -1;
    double d;
    bool b;
    const char *s;
    ASSERT_ERR(duet_json_get_int(root, "config.json", "num_heads", 1, 16, &i), DUET_ERR_RANGE,
               "config.json: field \"num_heads\": 32 is outside [1, 16]");
    cr_assert_eq(i, -1, "out-param untouched on failure");
    ASSERT_ERR(duet_json_get_int(root, "config.json", "rms_norm_eps", 0, 1, &i), DUET_ERR_FORMAT,
               "field \"rms_norm_eps\": expected integer, got real");
    ASSERT_ERR(duet_json_get_int(root, "config.json", "missing", 0, 1, &i), DUET_ERR_NOT_FOUND,
               "config.json: field \"missing\": missing");
    ASSERT_ERR(duet_json_get_int(root, "config.json", "rope_scaling", 0, 1, &i), DUET_ERR_FORMAT,
               "field \"rope_scaling\": expected integer, got null");
    ASSERT_ERR(duet_json_get_double(root, "config.json", "model_type", 0, 1, &d), DUET_ERR_FORMAT,
               "expected number, got string");
    ASSERT_ERR(duet_json_get_double(root, "config.json", "rope_theta", 0, 100, &d), DUET_ERR_RANGE,
               "rope_theta");
    ASSERT_ERR(duet_json_get_bool(root, "config.json", "num_heads", &b), DUET_ERR_FORMAT,
               "expected true or false, got integer");
    ASSERT_ERR(duet_json_get_string(root, "config.json", "num_heads", &s), DUET_ERR_FORMAT,
               "expected string");
    ASSERT_ERR(duet_json_get_int(root, "config.json", "experts[1].id", 0, 9, &i), DUET_ERR_FORMAT,
               "field \"experts[1].id\": expected integer, got string");
    ASSERT_ERR(duet_json_get_int(root, "config.json", "num_heads.x", 0, 9, &i), DUET_ERR_FORMAT,
               "\"num_heads\" is integer, expected object");
    ASSERT_ERR(duet_json_get_int(root, "config.json", "model_type[0]", 0, 9, &i), DUET_ERR_FORMAT,
               "\"model_type\" is string, expected array");
    ASSERT_ERR(duet_json_get_int(root, "config.json", "experts[9].id", 0, 9, &i),
               DUET_ERR_NOT_FOUND, "experts[9].id");
    ASSERT_ERR(duet_json_get_int(root, "config.json", "a..b", 0, 9, &i), DUET_ERR_INVALID,
               "malformed JSON path");
    ASSERT_ERR(duet_json_get_int(root, "config.json", "experts[x]", 0, 9, &i), DUET_ERR_INVALID,
               "malformed JSON path");
    ASSERT_ERR(duet_json_get_int(root, "config.json", "experts[-1]", 0, 9, &i), DUET_ERR_INVALID,
               "malformed JSON path");
    ASSERT_ERR(duet_json_get_int(root, "config.json", "", 0, 9, &i), DUET_ERR_INVALID,
               "empty JSON path");
    json_decref(root);

    json_t *arr = load("[1, 2]");
    ASSERT_ERR(duet_json_get_int(arr, "body", "x", 0, 9, &i), DUET_ERR_FORMAT,
               "the root is array, expected object");
    cr_assert_eq(duet_json_get_int(arr, "body", "[1]", 0, 9, &i), DUET_OK);
    cr_assert_eq(i, 2);
    json_decref(arr);
}

Test(common_json, optional_fields, .timeout = 10)
{
    json_t *root = load(config_json);
    int64_t i;
    double d;
    bool b;
    const char *s;
    cr_assert_eq(duet_json_get_int_opt(root, "c", "absent", 0, 9, 7, &i), DUET_OK);
    cr_assert_eq(i, 7);
    cr_assert_eq(duet_json_get_int_opt(root, "c", "rope_scaling", 0, 9, 5, &i), DUET_OK,
                 "null reads as absent");
    cr_assert_eq(i, 5);
    cr_assert_eq(duet_json_get_int_opt(root, "c", "rope_scaling.factor", 0, 9, 4, &i), DUET_OK,
                 "a path through null reads as absent");
    cr_assert_eq(i, 4);
    cr_assert_eq(duet_json_get_int_opt(root, "c", "num_heads", 0, 99, 7, &i), DUET_OK);
    cr_assert_eq(i, 32);
    ASSERT_ERR(duet_json_get_int_opt(root, "c", "num_heads", 0, 9, 7, &i), DUET_ERR_RANGE,
               "num_heads");
    ASSERT_ERR(duet_json_get_int_opt(root, "c", "model_type", 0, 9, 7, &i), DUET_ERR_FORMAT,
               "expected integer, got string");
    cr_assert_eq(duet_json_get_double_opt(root, "c", "absent", 0, 9, 0.5, &d), DUET_OK);
    cr_assert_eq(d, 0.5);
    cr_assert_eq(duet_json_get_bool_opt(root, "c", "absent", true, &b), DUET_OK);
    cr_assert_eq(b, true);
    ASSERT_ERR(duet_json_get_bool_opt(root, "c", "model_type", true, &b), DUET_ERR_FORMAT,
               "expected true or false");
    cr_assert_eq(duet_json_get_string_opt(root, "c", "absent", NULL, &s), DUET_OK);
    cr_assert_null(s);
    cr_assert_eq(duet_json_get_string_opt(root, "c", "model_type", "x", &s), DUET_OK);
    cr_assert_str_eq(s, "kimi_linear");
    json_decref(root);
}

Test(common_json, syntax_errors_report_line_and_column, .timeout = 10)
{
    json_t *root = NULL;
    const char *bad = "{\n  \"a\": 1,\n  \"b\": [1, 2,, 3]\n}\n";
    ASSERT_ERR(duet_json_load_buffer(bad, strlen(bad), "config.json", 1 << 20, &root),
               DUET_ERR_FORMAT, "config.json:3:");
    cr_assert_null(root);
    const char *trunc = "{\"a\": [1, 2";
    ASSERT_ERR(duet_json_load_buffer(trunc, strlen(trunc), "t.json", 1 << 20, &root),
               DUET_ERR_FORMAT, "t.json:1:");
    const char *dup = "{\"a\": 1, \"a\": 2}";
    ASSERT_ERR(duet_json_load_buffer(dup, strlen(dup), "d.json", 1 << 20, &root), DUET_ERR_FORMAT,
               "duplicate");
    ASSERT_ERR(duet_json_load_buffer("", 0, "e.json", 1 << 20, &root), DUET_ERR_FORMAT, "e.json");
    const char nul[] = "{\"a\": \"x\0y\"}";
    ASSERT_ERR(duet_json_load_buffer(nul, sizeof(nul) - 1, "n.json", 1 << 20, &root),
               DUET_ERR_FORMAT, "n.json");
}

Test(common_json, size_cap, .timeout = 10)
{
    json_t *root = NULL;
    char path[] = "/tmp/duet_json_XXXXXX";
    const char *doc = "{\"num_heads\": 32, \"pad\": \"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\"}";
    ASSERT_ERR(duet_json_load_buffer(doc, strlen(doc), "big.json", 16, &root), DUET_ERR_RANGE,
               "big.json");
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    cr_assert_eq(write(fd, doc, strlen(doc)), (ssize_t)strlen(doc));
    close(fd);
    ASSERT_ERR(duet_json_load_file(path, 16, &root), DUET_ERR_RANGE, "exceeds the limit of 16");
    cr_assert_null(root);
    cr_assert_eq(duet_json_load_file(path, DUET_JSON_DEFAULT_MAX_BYTES, &root), DUET_OK);
    int64_t v;
    cr_assert_eq(duet_json_get_int(root, path, "num_heads", 1, 64, &v), DUET_OK);
    cr_assert_eq(v, 32);
    json_decref(root);
    unlink(path);
    ASSERT_ERR(duet_json_load_file("/nonexistent/config.json", 100, &root), DUET_ERR_IO,
               "/nonexistent/config.json: cannot open");
}

Test(common_json, file_syntax_error_names_file, .timeout = 10)
{
    char path[] = "/tmp/duet_json_XXXXXX";
    int fd = mkstemp(path);
    const char *doc = "{\n\n  \"a\": tru\n}";
    cr_assert_eq(write(fd, doc, strlen(doc)), (ssize_t)strlen(doc));
    close(fd);
    json_t *root = NULL;
    char want[64];
    snprintf(want, sizeof(want), "%s:3:", path);
    ASSERT_ERR(duet_json_load_file(path, 1000, &root), DUET_ERR_FORMAT, want);
    unlink(path);
}

/* ------------------------------------------------------------ fuzz */

static uint64_t rng_state;

static uint64_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static bool status_known(duet_status_t st)
{
    return st == DUET_OK || st == DUET_ERR_FORMAT || st == DUET_ERR_RANGE ||
           st == DUET_ERR_NOT_FOUND || st == DUET_ERR_INVALID;
}

Test(common_json, fuzz_mutated_documents, .timeout = 60)
{
    static const char alphabet[] = "{}[]\":,0123456789.-+eE truefalsnl\\\n\x01\xff";
    size_t seed_len = strlen(config_json);
    char *buf = malloc(seed_len * 2 + 64);
    rng_state = 0x9e3779b97f4a7c15ull;

    for (int iter = 0; iter < 4000; iter++) {
        size_t len;
        if (iter % 4 == 3) { /* pure random bytes */
            len = rng() % 128;
            for (size_t i = 0; i < len; i++)
                buf[i] = (char)(rng() & 0xff);
        } else { /* the seed with a few mutations: flip, insert, delete, truncate */
            memcpy(buf, config_json, seed_len);
            len = seed_len;
            int n_mut = 1 + (int)(rng() % 4);
            for (int m = 0; m < n_mut && len > 0; m++) {
                size_t at = rng() % len;
                switch (rng() % 4) {
                case 0:
                    buf[at] = alphabet[rng() % (sizeof(alphabet) - 1)];
                    break;
                case 1:
                    memmove(buf + at + 1, buf + at, len - at);
                    buf[at] = alphabet[rng() % (sizeof(alphabet) - 1)];
                    len++;
                    break;
                case 2:
                    memmove(buf + at, buf + at + 1, len - at - 1);
                    len--;
                    break;
                default:
                    len = at;
                    break;
                }
            }
        }
        /* Plain checks: ctest runs with --full-stats, which ships every assertion. */
        json_t *root = NULL;
        duet_status_t st = duet_json_load_buffer(buf, len, "fuzz.json", 1 << 20, &root);
        if (st != DUET_OK && st != DUET_ERR_FORMAT)
            cr_assert_fail("iter %d: status %d", iter, st);
        if (st != DUET_OK) {
            if (strstr(duet_error_last(), "fuzz.json:") == NULL)
                cr_assert_fail("iter %d: detail \"%s\"", iter, duet_error_last());
            continue;
        }
        int64_t i, *arr = NULL;
        double d;
        bool b;
        const char *s;
        size_t n;
        bool ok = status_known(duet_json_get_int(root, "f", "num_heads", 1, 64, &i)) &&
                  status_known(duet_json_get_double(root, "f", "rms_norm_eps", 0, 1, &d)) &&
                  status_known(duet_json_get_bool_opt(root, "f", "tie_word_embeddings", 0, &b)) &&
                  status_known(duet_json_get_string(root, "f", "model_type", &s)) &&
                  status_known(duet_json_get_int_opt(root, "f", "experts[1].id", 0, 9, 0, &i));
        st = duet_json_get_int_array(root, "f", "linear_attn_config.kda_layers", 0, 99, &arr, &n);
        if (!ok || !status_known(st))
            cr_assert_fail("iter %d: unexpected status (%s)", iter, duet_error_last());
        if (st == DUET_OK)
            free(arr);
        json_decref(root);
    }
    free(buf);
}
