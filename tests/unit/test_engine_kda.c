/*
 * KDA core (kernels/cpu/kda.c): the chunked (WY/UT) form against the token-by-token recurrence, on
 * random inputs shaped like the real ones (L2-normalised q/k, q scaled by K^-1/2, g <= 0, β in (0,
 * 1)). Tolerance: max |chunked - recurrent| <= 1e-5 · max(1, max |recurrent|), for outputs and
 * state.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_kda.h"

static uint64_t rng_state = 88172645463325252ull;

static float frand(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)((rng_state >> 40) * (1.0 / 16777216.0));
}

typedef struct {
    float *q, *k, *v, *g, *beta;
} kda_inputs_t;

static void make_inputs(kda_inputs_t *in, int64_t n, int64_t K, int64_t V, float decay_scale)
{
    in->q = malloc(sizeof(float) * (size_t)(n * K));
    in->k = malloc(sizeof(float) * (size_t)(n * K));
    in->v = malloc(sizeof(float) * (size_t)(n * V));
    in->g = malloc(sizeof(float) * (size_t)(n * K));
    in->beta = malloc(sizeof(float) * (size_t)n);
    for (int64_t t = 0; t < n; t++) {
        float nq = 0, nk = 0;
        for (int64_t d = 0; d < K; d++) {
            in->q[t * K + d] = frand() * 2 - 1;
            in->k[t * K + d] = frand() * 2 - 1;
            nq += in->q[t * K + d] * in->q[t * K + d];
            nk += in->k[t * K + d] * in->k[t * K + d];
            in->g[t * K + d] = -decay_scale * frand();
        }
        for (int64_t d = 0; d < K; d++) {
            in->q[t * K + d] /= sqrtf(nq + 1e-6f) * sqrtf((float)K);
            in->k[t * K + d] /= sqrtf(nk + 1e-6f);
        }
        for (int64_t x = 0; x < V; x++)
            in->v[t * V + x] = frand() * 2 - 1;
        in->beta[t] = frand();
    }
}

static void free_inputs(kda_inputs_t *in)
{
    free(in->q);
    free(in->k);
    free(in->v);
    free(in->g);
    free(in->beta);
}

static float max_abs(const float *a, int64_t n)
{
    float m = 0;
    for (int64_t i = 0; i < n; i++)
        m = fmaxf(m, fabsf(a[i]));
    return m;
}

static float max_diff(const float *a, const float *b, int64_t n)
{
    float m = 0;
    for (int64_t i = 0; i < n; i++)
        m = fmaxf(m, fabsf(a[i] - b[i]));
    return m;
}

/* Run n tokens as `pieces` consecutive calls (state carried) with both forms and compare. */
static void check_case(int64_t n, int64_t K, int64_t V, int pieces, float decay_scale)
{
    kda_inputs_t in;
    make_inputs(&in, n, K, V, decay_scale);
    float *o_rec = calloc((size_t)(n * V), sizeof(float));
    float *o_chk = calloc((size_t)(n * V), sizeof(float));
    float *S_rec = calloc((size_t)(K * V), sizeof(float));
    float *S_chk = calloc((size_t)(K * V), sizeof(float));
    float *scr = malloc(sizeof(float) * (size_t)duet_cpu_kda_chunk_scratch_floats(K, V));
    /* a non-zero initial state, as after an earlier prompt */
    for (int64_t i = 0; i < K * V; i++)
        S_rec[i] = S_chk[i] = (frand() * 2 - 1) * 0.5f;

    int64_t at = 0;
    for (int p = 0; p < pieces; p++) {
        int64_t len = p == pieces - 1 ? n - at : n / pieces;
        duet_cpu_kda_head_io_t io = {
            .q = in.q + at * K,
            .q_stride = K,
            .k = in.k + at * K,
            .k_stride = K,
            .v = in.v + at * V,
            .v_stride = V,
            .g = in.g + at * K,
            .g_stride = K,
            .beta = in.beta + at,
            .beta_stride = 1,
            .o = o_rec + at * V,
            .o_stride = V,
            .n = len,
            .K = K,
            .V = V,
        };
        duet_cpu_kda_recurrent(&io, S_rec);
        io.o = o_chk + at * V;
        duet_cpu_kda_chunked(&io, S_chk, scr);
        at += len;
    }
    float ref = fmaxf(1.0f, max_abs(o_rec, n * V));
    float dout = max_diff(o_rec, o_chk, n * V) / ref;
    float sref = fmaxf(1.0f, max_abs(S_rec, K * V));
    float dst = max_diff(S_rec, S_chk, K * V) / sref;
    printf(
        "kda n=%-4lld K=%-3lld V=%-3lld pieces=%d decay=%.1f: max rel diff out %.3g state %.3g\n",
        (long long)n, (long long)K, (long long)V, pieces, (double)decay_scale, (double)dout,
        (double)dst);
    cr_expect_leq(dout, 1e-5f, "outputs differ: %g (n=%lld K=%lld)", (double)dout, (long long)n,
                  (long long)K);
    cr_expect_leq(dst, 1e-5f, "states differ: %g (n=%lld K=%lld)", (double)dst, (long long)n,
                  (long long)K);
    free(o_rec);
    free(o_chk);
    free(S_rec);
    free(S_chk);
    free(scr);
    free_inputs(&in);
}

Test(engine_kda, chunked_equals_recurrent, .timeout = 120)
{
    const int64_t ns[] = {1, 2, 17, 63, 64, 65, 128, 130, 200};
    for (size_t i = 0; i < sizeof(ns) / sizeof(ns[0]); i++)
        check_case(ns[i], 16, 16, 1, 0.5f);
    check_case(150, 32, 32, 1, 0.2f);
    check_case(100, 64, 32, 1, 1.0f);
}

Test(engine_kda, state_carries_across_calls, .timeout = 120)
{
    check_case(190, 16, 16, 3, 0.5f);
    check_case(129, 32, 16, 2, 0.3f);
}

Test(engine_kda, strong_decay_does_not_overflow, .timeout = 60)
{
    /* Γ reaches about -64 * 8: ratios of exponents would overflow, differences do not. */
    check_case(128, 16, 16, 1, 8.0f);
}
