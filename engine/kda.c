/*
 * KDA core, CPU reference. The recurrent form is the definition; the chunked form reorganises
 * it into matrix products over chunks of 64 tokens (transformers' chunk_kimi_delta_attention):
 * within a chunk the delta-rule updates are folded with the UT transform T = (I + A)^-1 Diag(β),
 * found by forward substitution, so the state is touched once per chunk instead of per token.
 * Pairwise decays e^{Γ_i − Γ_j} are never formed as a ratio of exponents (Γ is a cumulative
 * sum of non-positive values and e^{Γ} can underflow): they are products of per-token decays
 * <= 1, accumulated row by row, which is also how the recurrence applies them.
 * A final partial chunk needs no padding: padded rows of the reference have β = 0, k = 0, g = 0
 * and change neither the outputs nor the state.
 */
#include "engine/kda.h"

#include <math.h>
#include <string.h>

/* The loops below vectorise; build an AVX2/FMA and an AVX-512 copy next to the baseline one and
 * let the loader pick (the binary still runs on any x86-64). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DUET_KDA_CLONES __attribute__((target_clones("avx512f", "arch=haswell", "default")))
#else
#define DUET_KDA_CLONES
#endif

DUET_KDA_CLONES
void duet_kda_recurrent(const duet_kda_head_io_t *io, float *S)
{
    const int64_t K = io->K, V = io->V;
    for (int64_t t = 0; t < io->n; t++) {
        const float *q = io->q + t * io->q_stride;
        const float *k = io->k + t * io->k_stride;
        const float *v = io->v + t * io->v_stride;
        const float *g = io->g + t * io->g_stride;
        const float  b = io->beta[t * io->beta_stride];
        float       *o = io->o + t * io->o_stride;
        float        kv_mem[V];

        for (int64_t j = 0; j < V; j++)
            kv_mem[j] = 0.0f;
        for (int64_t i = 0; i < K; i++) {
            float *row = S + i * V;
            float  d   = expf(g[i]);
            float  ki  = k[i];
            for (int64_t j = 0; j < V; j++) {
                row[j] *= d;
                kv_mem[j] += row[j] * ki;
            }
        }
        for (int64_t j = 0; j < V; j++)
            kv_mem[j] = (v[j] - kv_mem[j]) * b; /* delta */
        for (int64_t j = 0; j < V; j++)
            o[j] = 0.0f;
        for (int64_t i = 0; i < K; i++) {
            float *row = S + i * V;
            float  ki = k[i], qi = q[i];
            for (int64_t j = 0; j < V; j++) {
                row[j] += ki * kv_mem[j];
                o[j] += row[j] * qi;
            }
        }
    }
}

int64_t duet_kda_chunk_scratch_floats(int64_t K, int64_t V)
{
    const int64_t C = DUET_KDA_CHUNK;
    /* gam[C][K], A[C][C], Aqk[C][C], U[C][V], W[C][K], KE[K][C], skk[C], sqk[C] */
    return C * K + 2 * C * C + C * V + C * K + K * C + 2 * C + 64;
}

DUET_KDA_CLONES
void duet_kda_chunked(const duet_kda_head_io_t *io, float *S, float *scratch)
{
    const int64_t C = DUET_KDA_CHUNK, K = io->K, V = io->V;
    float *gam = scratch;      /* [C][K] cumulative log-decay within the chunk */
    float *A   = gam + C * K;  /* [C][C] UT matrix, then T */
    float *Aqk = A + C * C;    /* [C][C] decayed q·k, j <= i */
    float *U   = Aqk + C * C;  /* [C][V] T·(βV), then v_new */
    float *W   = U + C * V;    /* [C][K] T·(β e^Γ K) */
    float *KE  = W + C * K;    /* [K][C] k_j · e^{Γi − Γj} for the current row i */
    float *skk = KE + K * C;   /* [C] */
    float *sqk = skk + C;      /* [C] */

    for (int64_t c0 = 0; c0 < io->n; c0 += C) {
        const int64_t n = io->n - c0 < C ? io->n - c0 : C;
#define Q_(i) (io->q + (c0 + (i)) * io->q_stride)
#define K_(i) (io->k + (c0 + (i)) * io->k_stride)
#define V_(i) (io->v + (c0 + (i)) * io->v_stride)
#define G_(i) (io->g + (c0 + (i)) * io->g_stride)
#define B_(i) (io->beta[(c0 + (i)) * io->beta_stride])
#define O_(i) (io->o + (c0 + (i)) * io->o_stride)
        for (int64_t i = 0; i < n; i++)
            for (int64_t d = 0; d < K; d++)
                gam[i * K + d] = (i > 0 ? gam[(i - 1) * K + d] : 0.0f) + G_(i)[d];

        /* A[i][j] = -β_i Σ_d k_i k_j e^{Γi-Γj} (j < i); Aqk[i][j] = Σ_d q_i k_j e^{Γi-Γj} (j <= i).
         * KE[d][j] holds k_j[d]·e^{Γi[d]-Γj[d]} for the current row i; moving to row i+1
         * multiplies it by e^{g_{i+1}} (a product of decays <= 1, as the recurrence itself does),
         * so a chunk costs C·K exponentials instead of C²·K/2. j runs innermost so the loops
         * vectorise. */
        for (int64_t i = 0; i < n; i++) {
            const float *ki = K_(i), *qi = Q_(i), *gi = G_(i);
            for (int64_t d = 0; d < K; d++) {
                float *ke = KE + d * C;
                float  eg = expf(gi[d]);
                for (int64_t j = 0; j < i; j++)
                    ke[j] *= eg;
                ke[i] = ki[d];
            }
            for (int64_t j = 0; j <= i; j++)
                skk[j] = sqk[j] = 0.0f;
            for (int64_t d = 0; d < K; d++) {
                const float *ke = KE + d * C;
                const float  kd = ki[d], qd = qi[d];
                for (int64_t j = 0; j <= i; j++) {
                    skk[j] += kd * ke[j];
                    sqk[j] += qd * ke[j];
                }
            }
            const float bi = B_(i);
            for (int64_t j = 0; j < i; j++)
                A[i * C + j] = -bi * skk[j];
            A[i * C + i] = 0.0f;
            for (int64_t j = 0; j <= i; j++)
                Aqk[i * C + j] = sqk[j];
        }
        /* Forward substitution: row i += row i · A[:i, :i] (rows above already transformed). */
        for (int64_t i = 1; i < n; i++) {
            float row[C];
            for (int64_t j = 0; j < i; j++)
                row[j] = A[i * C + j];
            for (int64_t j = 0; j < i; j++) {
                float s = 0.0f;
                for (int64_t m = j + 1; m < i; m++)
                    s += row[m] * A[m * C + j];
                A[i * C + j] = row[j] + s;
            }
        }
        /* T = A + I: U = T (β V), W = T (β e^Γ K). Rows start as βv and βk·e^Γ and are
         * transformed bottom-up, so rows j < i still hold their untransformed values. */
        for (int64_t i = 0; i < n; i++) {
            float bi = B_(i);
            for (int64_t x = 0; x < V; x++)
                U[i * V + x] = bi * V_(i)[x];
            for (int64_t d = 0; d < K; d++)
                W[i * K + d] = bi * K_(i)[d] * expf(gam[i * K + d]);
        }
        for (int64_t i = n - 1; i > 0; i--) {
            float *u = U + i * V, *w = W + i * K;
            for (int64_t j = 0; j < i; j++) {
                float a = A[i * C + j];
                if (a == 0.0f)
                    continue;
                const float *uj = U + j * V, *wj = W + j * K;
                for (int64_t x = 0; x < V; x++)
                    u[x] += a * uj[x];
                for (int64_t d = 0; d < K; d++)
                    w[d] += a * wj[d];
            }
        }
        /* v_new = U - W S ; O = (Q e^Γ) S + Aqk v_new */
        for (int64_t i = 0; i < n; i++) {
            float       *u = U + i * V;
            const float *w = W + i * K;
            for (int64_t d = 0; d < K; d++) {
                const float *srow = S + d * V;
                float        wd   = w[d];
                for (int64_t x = 0; x < V; x++)
                    u[x] -= wd * srow[x];
            }
        }
        for (int64_t i = 0; i < n; i++) {
            float       *o  = O_(i);
            const float *qi = Q_(i);
            for (int64_t x = 0; x < V; x++)
                o[x] = 0.0f;
            for (int64_t d = 0; d < K; d++) {
                const float *srow = S + d * V;
                float        qd   = qi[d] * expf(gam[i * K + d]);
                for (int64_t x = 0; x < V; x++)
                    o[x] += qd * srow[x];
            }
            for (int64_t j = 0; j <= i; j++) {
                const float *u = U + j * V;
                float        a = Aqk[i * C + j];
                for (int64_t x = 0; x < V; x++)
                    o[x] += a * u[x];
            }
        }
        /* S = e^{Γlast} S + (K e^{Γlast − Γ})ᵀ v_new */
        const float *glast = gam + (n - 1) * K;
        for (int64_t d = 0; d < K; d++) {
            float *srow = S + d * V;
            float  dec  = expf(glast[d]);
            for (int64_t x = 0; x < V; x++)
                srow[x] *= dec;
            for (int64_t i = 0; i < n; i++) {
                float        kd = K_(i)[d] * expf(glast[d] - gam[i * K + d]);
                const float *u  = U + i * V;
                for (int64_t x = 0; x < V; x++)
                    srow[x] += kd * u[x];
            }
        }
#undef Q_
#undef K_
#undef V_
#undef G_
#undef B_
#undef O_
    }
}
