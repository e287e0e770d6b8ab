/*
 * test_engine_dtype.c: what --dtype resolves to (engine/model.c duet_model_dtype_resolve and
 * duet_model_dtype_parse), and that a load applies it.
 *
 * The expected table is the rule stated in engine/model.h and in --help, written out case by
 * case: on the CPU always F32; on CUDA an explicit request as asked, and auto = the checkpoint's
 * dtype where CUDA computes in it (BF16), else F32 (F32 and F16 checkpoints). The checkpoint's
 * dtype of the committed fixtures comes from their files (duet_checkpoint_dtype), so the auto
 * column is also checked on real checkpoints written by transformers.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "engine/checkpoint.h"
#include "engine/model.h"

Test(engine_dtype, parse_and_names)
{
    static const struct {
        const char *s;
        duet_model_dtype_t want;
    } ok[] = {{"auto", DUET_MODEL_DTYPE_AUTO},
              {"f32", DUET_MODEL_DTYPE_F32},
              {"bf16", DUET_MODEL_DTYPE_BF16}};
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        duet_model_dtype_t dt = (duet_model_dtype_t)99;
        cr_assert_eq(duet_model_dtype_parse(ok[i].s, &dt), DUET_OK, "%s", ok[i].s);
        cr_assert_eq(dt, ok[i].want, "%s", ok[i].s);
        cr_assert_str_eq(duet_model_dtype_name(dt), ok[i].s);
    }
    static const char *bad[] = {"fp16", "F32", "bfloat16", "", "auto "};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        duet_model_dtype_t dt = DUET_MODEL_DTYPE_F32;
        cr_assert_eq(duet_model_dtype_parse(bad[i], &dt), DUET_ERR_INVALID, "'%s'", bad[i]);
        cr_assert_eq(dt, DUET_MODEL_DTYPE_F32, "written on failure");
        cr_assert_not_null(strstr(duet_error_last(), "auto, f32 or bf16"), "%s", duet_error_last());
    }
    duet_model_dtype_t dt;
    cr_assert_eq(duet_model_dtype_parse(NULL, &dt), DUET_ERR_INVALID);
    cr_assert_str_eq(duet_model_dtype_name((duet_model_dtype_t)7), "?");
}

Test(engine_dtype, resolve_table)
{
    const duet_dtype_t F32 = DUET_DTYPE_F32, BF16 = DUET_DTYPE_BF16, F16 = DUET_DTYPE_F16;
    const duet_device_kind_t CPU = DUET_DEVICE_CPU, CUDA = DUET_DEVICE_CUDA;
    static const struct {
        duet_device_kind_t dev;
        duet_dtype_t ckpt;
        duet_model_dtype_t req;
        duet_dtype_t want;
    } cases[] = {
        /* the CPU computes in f32 whatever is asked */
        {CPU, F32, DUET_MODEL_DTYPE_AUTO, F32},
        {CPU, BF16, DUET_MODEL_DTYPE_AUTO, F32},
        {CPU, F16, DUET_MODEL_DTYPE_AUTO, F32},
        {CPU, F32, DUET_MODEL_DTYPE_F32, F32},
        {CPU, BF16, DUET_MODEL_DTYPE_F32, F32},
        {CPU, F16, DUET_MODEL_DTYPE_F32, F32},
        {CPU, F32, DUET_MODEL_DTYPE_BF16, F32},
        {CPU, BF16, DUET_MODEL_DTYPE_BF16, F32},
        {CPU, F16, DUET_MODEL_DTYPE_BF16, F32},
        /* cuda, auto: the published bf16 checkpoint computes in bf16; f32 stays f32; f16 is
         * not rounded to bf16 */
        {CUDA, BF16, DUET_MODEL_DTYPE_AUTO, BF16},
        {CUDA, F32, DUET_MODEL_DTYPE_AUTO, F32},
        {CUDA, F16, DUET_MODEL_DTYPE_AUTO, F32},
        /* cuda, explicit: as asked */
        {CUDA, BF16, DUET_MODEL_DTYPE_F32, F32},
        {CUDA, F32, DUET_MODEL_DTYPE_F32, F32},
        {CUDA, F16, DUET_MODEL_DTYPE_F32, F32},
        {CUDA, BF16, DUET_MODEL_DTYPE_BF16, BF16},
        {CUDA, F32, DUET_MODEL_DTYPE_BF16, BF16},
        {CUDA, F16, DUET_MODEL_DTYPE_BF16, BF16},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        duet_dtype_t got = (duet_dtype_t)99;
        cr_assert_eq(duet_model_dtype_resolve(cases[i].dev, cases[i].ckpt, cases[i].req, &got),
                     DUET_OK, "case %zu: %s", i, duet_error_last());
        cr_expect_eq(got, cases[i].want, "case %zu (%s, %s checkpoint, %s): got %s, want %s", i,
                     duet_model_device_name(cases[i].dev), duet_dtype_name(cases[i].ckpt),
                     duet_model_dtype_name(cases[i].req), duet_dtype_name(got),
                     duet_dtype_name(cases[i].want));
    }
    /* values outside the enums are refused, and nothing is written */
    duet_dtype_t got = F16;
    cr_assert_eq(duet_model_dtype_resolve((duet_device_kind_t)5, F32, DUET_MODEL_DTYPE_AUTO, &got),
                 DUET_ERR_INVALID);
    cr_assert_eq(duet_model_dtype_resolve(CUDA, (duet_dtype_t)9, DUET_MODEL_DTYPE_AUTO, &got),
                 DUET_ERR_INVALID);
    cr_assert_eq(duet_model_dtype_resolve(CUDA, F32, (duet_model_dtype_t)3, &got),
                 DUET_ERR_INVALID);
    cr_assert_eq(got, F16);
}

/* What auto gives on cuda for committed fixtures, from the dtype their files hold. */
Test(engine_dtype, auto_follows_the_fixtures_files)
{
    static const struct {
        const char *fixture;
        duet_dtype_t ckpt, on_cuda;
    } cases[] = {
        {"kda-first-fp32", DUET_DTYPE_F32, DUET_DTYPE_F32},
        {"save-pretrained-bf16", DUET_DTYPE_BF16, DUET_DTYPE_BF16},
        {"save-pretrained-bf16/internal", DUET_DTYPE_BF16, DUET_DTYPE_BF16},
        /* bf16 with its e_score_correction_bias / A_log / dt_bias kept in f32 */
        {"mla-first-bf16-mixed-norenorm", DUET_DTYPE_BF16, DUET_DTYPE_BF16},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char dir[1024];
        snprintf(dir, sizeof(dir), "%s/tests/fixtures/%s", DUET_SOURCE_DIR, cases[i].fixture);
        duet_checkpoint_t *ck;
        cr_assert_eq(duet_checkpoint_open(dir, &ck), DUET_OK, "%s", duet_error_last());
        duet_dtype_t ckdt = duet_checkpoint_dtype(ck), got;
        duet_checkpoint_close(ck);
        cr_expect_eq(ckdt, cases[i].ckpt, "%s: checkpoint dtype %s", cases[i].fixture,
                     duet_dtype_name(ckdt));
        cr_assert_eq(duet_model_dtype_resolve(DUET_DEVICE_CUDA, ckdt, DUET_MODEL_DTYPE_AUTO, &got),
                     DUET_OK);
        cr_expect_eq(got, cases[i].on_cuda, "%s: auto on cuda gives %s", cases[i].fixture,
                     duet_dtype_name(got));
    }
}

/* A CPU load applies the resolution: f32 compute whatever was asked (and a caller's
 * compute_dtype is not what decides). */
Test(engine_dtype, cpu_load_computes_in_f32)
{
    char dir[1024];
    snprintf(dir, sizeof(dir), "%s/tests/fixtures/save-pretrained-bf16", DUET_SOURCE_DIR);
    for (int r = 0; r < 3; r++) {
        duet_model_opts_t o;
        duet_model_opts_default(&o);
        cr_assert_eq(o.dtype, DUET_MODEL_DTYPE_AUTO, "the default request is auto");
        o.n_threads = 1;
        o.max_seqs = 1;
        o.max_seq_len = 64;
        o.dtype = (duet_model_dtype_t)r;
        o.compute_dtype = DUET_DTYPE_BF16;
        duet_model_t *m = NULL;
        cr_assert_eq(duet_model_load(dir, &o, &m), DUET_OK, "%s", duet_error_last());
        cr_expect_eq(duet_model_opts(m)->compute_dtype, DUET_DTYPE_F32, "request %s",
                     duet_model_dtype_name(o.dtype));
        cr_expect_eq(duet_model_opts(m)->dtype, o.dtype);
        duet_model_free(m);
    }
    /* an unknown request is refused before anything loads */
    duet_model_opts_t o;
    duet_model_opts_default(&o);
    o.dtype = (duet_model_dtype_t)9;
    duet_model_t *m = NULL;
    cr_assert_eq(duet_model_load(dir, &o, &m), DUET_ERR_INVALID);
    cr_assert_null(m);
}

/* Random weights have no checkpoint dtype for auto to follow. */
Test(engine_dtype, random_weights_need_an_explicit_dtype)
{
    char dir[1024];
    snprintf(dir, sizeof(dir), "%s/tests/fixtures/kda-first-fp32", DUET_SOURCE_DIR);
    duet_model_config_t cfg;
    cr_assert_eq(duet_model_config_load(dir, &cfg), DUET_OK, "%s", duet_error_last());
    duet_model_opts_t o;
    duet_model_opts_default(&o);
    o.device = DUET_DEVICE_CUDA;
    duet_model_t *m = NULL;
    cr_assert_eq(duet_model_create_random(&cfg, &o, 1, &m), DUET_ERR_INVALID);
    cr_assert_not_null(strstr(duet_error_last(), "f32 or bf16"), "%s", duet_error_last());
    cr_assert_null(m);
}
