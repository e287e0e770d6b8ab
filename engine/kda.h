/*
 * KDA (Kimi Delta Attention) core on one head, CPU reference (docs/model.md, "KDA mixer").
 *
 * Inputs are the per-token vectors after the short conv, SiLU, L2 normalisation and query
 * scaling: q, k, g of K values, v of V values, beta a scalar, all fp32. Rows of token t are at
 * `x + t * stride` so the caller can pass one head's columns of a [T, H*K] matrix. The state S
 * (K x V, row i = key channel i) is updated in place and on return is the state after the last
 * token. Both forms compute the same function; the chunked one is the prefill path.
 */
#ifndef DUET_ENGINE_KDA_H
#define DUET_ENGINE_KDA_H

#include <stdint.h>

#define DUET_KDA_CHUNK 64

typedef struct {
    const float *q;    int64_t q_stride;    /* [n][K] */
    const float *k;    int64_t k_stride;    /* [n][K] */
    const float *v;    int64_t v_stride;    /* [n][V] */
    const float *g;    int64_t g_stride;    /* [n][K] log-decay, <= 0 */
    const float *beta; int64_t beta_stride; /* [n] */
    float       *o;    int64_t o_stride;    /* [n][V] output */
    int64_t      n, K, V;
} duet_kda_head_io_t;

/* Token-by-token recurrence. */
void duet_kda_recurrent(const duet_kda_head_io_t *io, float *S);

/* Floats of scratch duet_kda_chunked needs for head sizes K, V. */
int64_t duet_kda_chunk_scratch_floats(int64_t K, int64_t V);

/* Chunked (WY/UT) form, chunks of DUET_KDA_CHUNK tokens; `scratch` has
 * duet_kda_chunk_scratch_floats(K, V) floats. */
void duet_kda_chunked(const duet_kda_head_io_t *io, float *S, float *scratch);

#endif
