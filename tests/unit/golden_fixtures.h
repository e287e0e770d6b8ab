/*
 * golden_fixtures.h: loading tests/fixtures (transformers' reference runs, tools/make_fixtures.py)
 * for the engine tests that compare against them (test_engine_golden.c on the CPU,
 * test_engine_cuda.c on the GPU). Header-only: static helpers, Criterion asserts.
 */
#ifndef DUET_TESTS_GOLDEN_FIXTURES_H
#define DUET_TESTS_GOLDEN_FIXTURES_H

#include <criterion/criterion.h>
#include <dirent.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_FIXTURES 16
#define MAX_VARIANTS 4

typedef struct {
    char dir[2048];
    char name[256];
    int32_t *prompt;
    int64_t n_prompt;
    int32_t greedy[64];
    int64_t n_greedy;
    float *logits;      /* (n_prompt, vocab) fp32 reference */
    float *logits_bf16; /* transformers' bf16 compute, bf16 fixtures only */
    int64_t vocab;
    /* subfolders holding the same weights under other names (golden.json "variants"): the
     * same goldens apply to each */
    char variants[MAX_VARIANTS][64];
    int n_variants;
} fixture_t;

static int load_ids(json_t *arr, int32_t *out, int64_t cap, int64_t *n_p)
{
    if (!json_is_array(arr) || (int64_t)json_array_size(arr) > cap)
        return -1;
    for (size_t i = 0; i < json_array_size(arr); i++)
        out[i] = (int32_t)json_integer_value(json_array_get(arr, i));
    *n_p = (int64_t)json_array_size(arr);
    return 0;
}

static float *load_f32(const char *dir, const char *file, int64_t n)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, file);
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "cannot open %s", path);
    float *buf = malloc(sizeof(float) * (size_t)n);
    cr_assert_eq(fread(buf, sizeof(float), (size_t)n, f), (size_t)n, "%s is short", path);
    fclose(f);
    return buf;
}

static int load_fixtures(fixture_t *fx, int cap)
{
    char root[1500];
    snprintf(root, sizeof(root), "%s/tests/fixtures", DUET_SOURCE_DIR);
    DIR *d = opendir(root);
    cr_assert_not_null(d, "no fixtures folder %s", root);
    int n = 0;
    struct dirent *de;
    char names[MAX_FIXTURES][256];
    while ((de = readdir(d)) != NULL && n < cap) {
        char path[4096];
        snprintf(path, sizeof(path), "%s/%s/golden.json", root, de->d_name);
        FILE *f = fopen(path, "r");
        if (f == NULL)
            continue;
        fclose(f);
        snprintf(names[n++], sizeof(names[0]), "%s", de->d_name);
    }
    closedir(d);
    /* stable order */
    qsort(names, (size_t)n, sizeof(names[0]), (int (*)(const void *, const void *))strcmp);
    for (int i = 0; i < n; i++) {
        fixture_t *x = &fx[i];
        memset(x, 0, sizeof(*x));
        snprintf(x->name, sizeof(x->name), "%.200s", names[i]);
        snprintf(x->dir, sizeof(x->dir), "%.1400s/%.200s", root, names[i]);
        char path[4096];
        snprintf(path, sizeof(path), "%s/golden.json", x->dir);
        json_error_t jerr;
        json_t *g = json_load_file(path, 0, &jerr);
        cr_assert_not_null(g, "%s: %s", path, jerr.text);
        json_t *pa = json_object_get(g, "prompt_ids");
        cr_assert(json_is_array(pa));
        x->n_prompt = (int64_t)json_array_size(pa);
        x->prompt = malloc(sizeof(int32_t) * (size_t)x->n_prompt);
        for (int64_t t = 0; t < x->n_prompt; t++)
            x->prompt[t] = (int32_t)json_integer_value(json_array_get(pa, (size_t)t));
        cr_assert_eq(load_ids(json_object_get(g, "greedy_ids"), x->greedy, 64, &x->n_greedy), 0);
        x->vocab = json_integer_value(json_object_get(g, "vocab_size"));
        x->logits = load_f32(x->dir, json_string_value(json_object_get(g, "logits_file")),
                             x->n_prompt * x->vocab);
        const char *bf = json_string_value(json_object_get(g, "bf16_logits_file"));
        if (bf != NULL)
            x->logits_bf16 = load_f32(x->dir, bf, x->n_prompt * x->vocab);
        json_t *va = json_object_get(g, "variants");
        cr_assert(va == NULL || (json_is_array(va) && json_array_size(va) <= MAX_VARIANTS),
                  "%s: \"variants\" must be an array of at most %d folder names", path,
                  MAX_VARIANTS);
        for (size_t k = 0; va != NULL && k < json_array_size(va); k++) {
            const char *v = json_string_value(json_array_get(va, k));
            cr_assert(v != NULL && strlen(v) < sizeof(x->variants[0]) && strchr(v, '/') == NULL,
                      "%s: bad variant %zu", path, k);
            snprintf(x->variants[x->n_variants++], sizeof(x->variants[0]), "%s", v);
        }
        json_decref(g);
    }
    return n;
}

static void free_fixtures(fixture_t *fx, int n)
{
    for (int i = 0; i < n; i++) {
        free(fx[i].prompt);
        free(fx[i].logits);
        free(fx[i].logits_bf16);
    }
}

static inline double max_abs_diff(const float *a, const float *ref, int64_t n)
{
    double m = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)ref[i]);
        m = d > m ? d : m;
    }
    return m;
}

static inline double rel_l2(const float *a, const float *ref, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)ref[i];
        num += d * d;
        den += (double)ref[i] * (double)ref[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

#endif
