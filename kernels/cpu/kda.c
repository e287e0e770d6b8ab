/*
 * kda.c: the KDA mixer on the CPU (contract in cpu_kda.h): the delta-rule core of one head in its
 * two forms, and the step-level conv, prep, core and out that run them per (item, head) on the
 * thread pool.
 *
 * The recurrent form is the definition; the chunked form reorganises
 * it into matrix products over chunks of 64 tokens (transformers' chunk_kimi_delta_attention):
 * within a chunk the delta-rule updates are folded with the UT transform T = (I + A)^-1 Diag(β),
 * found by forward substitution, so the state is touched once per chunk instead of per token.
 * Pairwise decays e^{Γ_i − Γ_j} are never formed as a ratio of exponents (Γ is a cumulative
 * sum of non-positive values and e^{Γ} can underflow): they are products of per-token decays
 * <= 1, accumulated row by row, which is also how the recurrence applies them.
 * A final partial chunk needs no padding: padded rows of the reference have β = 0, k = 0, g = 0
 * and change neither the outputs nor the state.
 *
 * Verify items and replays (speculative decoding, cpu_kda.h) call the same recurrent function as a
 * one-token step, on the same values, so their arithmetic is the one-token step's by construction
 * rather than by a second copy of it.
 */
#include "kernels/cpu/cpu_kda.h"

#include <math.h>
#include <string.h>

#include "kernels/cpu/isa.h"

DUET__CPU_CLONES
void duet_cpu_kda_recurrent(const duet_cpu_kda_head_io_t *io, float *S)
{
    const int64_t K = io->K, V = io->V;
    for (int64_t t = 0; t < io->n; t++) {
        const float *q = io->q + t * io->q_stride;
        const float *k = io->k + t * io->k_stride;
        const float *v = io->v + t * io->v_stride;
        const float *g = io->g + t * io->g_stride;
        const float b = io->beta[t * io->beta_stride];
        float *o = io->o + t * io->o_stride;
        float kv_mem[V];

        for (int64_t j = 0; j < V; j++)
            kv_mem[j] = 0.0f;
        for (int64_t i = 0; i < K; i++) {
            float *row = S + i * V;
            float d = expf(g[i]);
            float ki = k[i];
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
            float ki = k[i], qi = q[i];
            for (int64_t j = 0; j < V; j++) {
                row[j] += ki * kv_mem[j];
                o[j] += row[j] * qi;
            }
        }
    }
}

int64_t duet_cpu_kda_chunk_scratch_floats(int64_t K, int64_t V)
{
    const int64_t C = DUET_KDA_CHUNK;
    /* gam[C][K], A[C][C], Aqk[C][C], U[C][V], W[C][K], KE[K][C], skk[C], sqk[C] */
    return C * K + 2 * C * C + C * V + C * K + K * C + 2 * C + 64;
}

DUET__CPU_CLONES
void duet_cpu_kda_chunked(const duet_cpu_kda_head_io_t *io, float *S, float *scratch)
{
    const int64_t C = DUET_KDA_CHUNK, K = io->K, V = io->V;
    float *gam = scratch;    /* [C][K] cumulative log-decay within the chunk */
    float *A = gam + C * K;  /* [C][C] UT matrix, then T */
    float *Aqk = A + C * C;  /* [C][C] decayed q·k, j <= i */
    float *U = Aqk + C * C;  /* [C][V] T·(βV), then v_new */
    float *W = U + C * V;    /* [C][K] T·(β e^Γ K) */
    float *KE = W + C * K;   /* [K][C] k_j · e^{Γi − Γj} for the current row i */
    float *skk = KE + K * C; /* [C] */
    float *sqk = skk + C;    /* [C] */

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
                float eg = expf(gi[d]);
                for (int64_t j = 0; j < i; j++)
                    ke[j] *= eg;
                ke[i] = ki[d];
            }
            for (int64_t j = 0; j <= i; j++)
                skk[j] = sqk[j] = 0.0f;
            for (int64_t d = 0; d < K; d++) {
                const float *ke = KE + d * C;
                const float kd = ki[d], qd = qi[d];
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
            float *u = U + i * V;
            const float *w = W + i * K;
            for (int64_t d = 0; d < K; d++) {
                const float *srow = S + d * V;
                float wd = w[d];
                for (int64_t x = 0; x < V; x++)
                    u[x] -= wd * srow[x];
            }
        }
        for (int64_t i = 0; i < n; i++) {
            float *o = O_(i);
            const float *qi = Q_(i);
            for (int64_t x = 0; x < V; x++)
                o[x] = 0.0f;
            for (int64_t d = 0; d < K; d++) {
                const float *srow = S + d * V;
                float qd = qi[d] * expf(gam[i * K + d]);
                for (int64_t x = 0; x < V; x++)
                    o[x] += qd * srow[x];
            }
            for (int64_t j = 0; j <= i; j++) {
                const float *u = U + j * V;
                float a = Aqk[i * C + j];
                for (int64_t x = 0; x < V; x++)
                    o[x] += a * u[x];
            }
        }
        /* S = e^{Γlast} S + (K e^{Γlast − Γ})ᵀ v_new */
        const float *glast = gam + (n - 1) * K;
        for (int64_t d = 0; d < K; d++) {
            float *srow = S + d * V;
            float dec = expf(glast[d]);
            for (int64_t x = 0; x < V; x++)
                srow[x] *= dec;
            for (int64_t i = 0; i < n; i++) {
                float kd = K_(i)[d] * expf(glast[d] - gam[i * K + d]);
                const float *u = U + i * V;
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

/* ---- a step ---------------------------------------------------------------------------------- */

#define DUET_L2_EPS 1e-6f /* q, k L2 norms: eps inside the sqrt (transformers' l2norm) */

static inline float duet__sigmoid(float x)
{
    return 1.0f / (1.0f + expf(-x));
}

static inline float duet__silu(float x)
{
    return x / (1.0f + expf(-x));
}

static inline float duet__softplus(float x)
{
    return x > 20.0f ? x : log1pf(expf(x));
}

static float *duet__kda_conv_window(const duet_cpu_kda_layer_t *ly, int32_t slot)
{
    uint64_t off = 0;
    (void)duet_kda_layout_conv_offset(&ly->layout, (uint64_t)slot, (uint64_t)ly->layer, 0, 0, &off);
    return (float *)((uint8_t *)ly->kda_base + off);
}

static float *duet__kda_state(const duet_cpu_kda_layer_t *ly, int32_t slot, int64_t head)
{
    uint64_t off = 0;
    (void)duet_kda_layout_state_offset(&ly->layout, (uint64_t)slot, (uint64_t)ly->layer,
                                       (uint64_t)head, &off);
    return (float *)((uint8_t *)ly->kda_base + off);
}

/* Row `row` of the item's replay block in this layer (common/cache_layout.h); the block's rows
 * follow each other, duet__kda_replay_row_floats apart. */
static float *duet__kda_replay_row(const duet_cpu_kda_layer_t *ly, int32_t slot, int64_t row)
{
    uint64_t off = 0;
    (void)duet_replay_layout_row_offset(&ly->replay, (uint64_t)slot, (uint64_t)ly->layer,
                                        (uint64_t)row, &off);
    return (float *)((uint8_t *)ly->replay_base + off);
}

static int64_t duet__kda_replay_row_floats(const duet_cpu_kda_layer_t *ly)
{
    uint64_t b = 0;
    (void)duet_replay_layout_row_bytes(&ly->replay, &b);
    return (int64_t)(b / sizeof(float));
}

static int duet__kda_is_verify(const duet_cpu_step_t *st, int64_t it)
{
    return st->item_verify != NULL && st->item_verify[it] != 0;
}

int64_t duet_cpu_kda_verify_scratch_floats(int64_t K)
{
    return K * K + K;
}

typedef struct {
    const duet_cpu_step_t *st;
    const duet_cpu_kda_layer_t *ly;
    float *scratch;
    int64_t per_thread;
} duet__kda_replay_ctx_t;

/* One (item, head): the accepted rows' recurrence on S, then the windows of the head's channels
 * of q, k and v (K each) keep the last W-1 of (window, the rows' projections). */
static void duet__kda_replay_task(void *vctx, int64_t b, int64_t e, int tid)
{
    const duet__kda_replay_ctx_t *cx = vctx;
    const duet_cpu_step_t *st = cx->st;
    const duet_cpu_kda_layer_t *ly = cx->ly;
    const int64_t H = (int64_t)ly->layout.heads, K = (int64_t)ly->layout.head_dim, HK = H * K;
    const int64_t W1 = (int64_t)ly->layout.conv_kernel - 1, RF = duet__kda_replay_row_floats(ly);

    for (int64_t idx = b; idx < e; idx++) {
        const int64_t it = idx / H, h = idx % H, n = st->item_replay[it];
        if (n == 0)
            continue;
        const int32_t slot = st->item_slot[it];
        const float *rows = duet__kda_replay_row(ly, slot, 0);
        const float *kr = rows + DUET_REPLAY_FIELD_K * HK + h * K;
        /* q is not stored: the output is not needed, and the state update does not read q, so k
         * stands in for it and the outputs go to one scratch row (o_stride 0) */
        duet_cpu_kda_head_io_t io = {
            .q = kr,
            .q_stride = RF,
            .k = kr,
            .k_stride = RF,
            .v = rows + DUET_REPLAY_FIELD_V * HK + h * K,
            .v_stride = RF,
            .g = rows + DUET_REPLAY_FIELD_G * HK + h * K,
            .g_stride = RF,
            .beta = rows + DUET_REPLAY_FIELD_BETA * HK + h,
            .beta_stride = RF,
            .o = cx->scratch + (int64_t)tid * cx->per_thread,
            .o_stride = 0,
            .n = n,
            .K = K,
            .V = K,
        };
        duet_cpu_kda_recurrent(&io, duet__kda_state(ly, slot, h));
        /* window ++ projections, keep the last W-1; in place, reading ahead of the write */
        float *win0 = duet__kda_conv_window(ly, slot); /* [3*H*K][W-1] */
        for (int64_t which = 0; which < 3; which++)
            for (int64_t d = 0; d < K; d++) {
                const int64_t c = which * HK + h * K + d;
                float *win = win0 + c * W1;
                for (int64_t j = 0; j < W1; j++) {
                    const int64_t i = n + j;
                    win[j] = i < W1 ? win[i] : rows[(i - W1) * RF + DUET_REPLAY_FIELD_PROJ + c];
                }
            }
    }
}

void duet_cpu_kda_replay(duet_kernels_t *k, const duet_cpu_step_t *st,
                         const duet_cpu_kda_layer_t *ly, float *scratch, int64_t scratch_per_thread)
{
    int any = 0;
    for (int64_t it = 0; st->item_replay != NULL && it < st->n_items; it++)
        any |= st->item_replay[it] > 0;
    if (!any)
        return;
    duet__kda_replay_ctx_t cx = {
        .st = st, .ly = ly, .scratch = scratch, .per_thread = scratch_per_thread};
    duet_k_parallel_for(k, st->n_items * (int64_t)ly->layout.heads, 1, duet__kda_replay_task, &cx);
}

/* Causal depthwise conv + SiLU over one (item, block of channels), then the window keeps the
 * last W-1 pre-conv inputs (a verify item's window stays; its inputs go to its replay rows).
 * Tokens run outside and channels inside, so rows are read contiguously and the channel loop
 * vectorises. */
#define DUET_CONV_BLOCK 64

typedef struct {
    const duet_cpu_step_t *st;
    const duet_cpu_kda_layer_t *ly;
    const float *taps;
    const float *proj;
    float *qkv;
} duet__kda_conv_ctx_t;

DUET__CPU_CLONES
static void duet__kda_conv_task(void *vctx, int64_t b, int64_t e, int tid)
{
    const duet__kda_conv_ctx_t *cx = vctx;
    const duet_cpu_step_t *st = cx->st;
    const int64_t C3 = 3 * (int64_t)cx->ly->layout.heads * (int64_t)cx->ly->layout.head_dim;
    const int64_t W = (int64_t)cx->ly->layout.conv_kernel;
    const int64_t nblk = (C3 + DUET_CONV_BLOCK - 1) / DUET_CONV_BLOCK;
    const float *taps = cx->taps;

    for (int64_t idx = b; idx < e; idx++) {
        const int64_t it = idx / nblk, c0 = (idx % nblk) * DUET_CONV_BLOCK;
        const int64_t nc = C3 - c0 < DUET_CONV_BLOCK ? C3 - c0 : DUET_CONV_BLOCK;
        const int64_t r0 = st->item_row0[it], n = st->item_row0[it + 1] - r0;
        float *win = duet__kda_conv_window(cx->ly, st->item_slot[it]); /* [C3][W-1] */
        /* the window transposed to [W-1][block] so every input row is contiguous */
        float hist[64][DUET_CONV_BLOCK]; /* W - 1 < 64, checked when the config is parsed */
        for (int64_t j = 0; j < W - 1; j++)
            for (int64_t ch = 0; ch < nc; ch++)
                hist[j][ch] = win[(c0 + ch) * (W - 1) + j];
        for (int64_t t = 0; t < n; t++) {
            float acc[DUET_CONV_BLOCK];
            for (int64_t ch = 0; ch < nc; ch++)
                acc[ch] = 0.0f;
            for (int64_t j = 0; j < W; j++) {
                int64_t tau = t - (W - 1) + j;
                const float *u = tau >= 0 ? cx->proj + (r0 + tau) * C3 + c0 : hist[(W - 1) + tau];
                for (int64_t ch = 0; ch < nc; ch++)
                    acc[ch] += taps[(c0 + ch) * W + j] * u[ch];
            }
            float *out = cx->qkv + (r0 + t) * C3 + c0;
            for (int64_t ch = 0; ch < nc; ch++)
                out[ch] = duet__silu(acc[ch]);
        }
        if (duet__kda_is_verify(st, it)) {
            for (int64_t t = 0; t < n; t++) {
                float *row = duet__kda_replay_row(cx->ly, st->item_slot[it], t);
                memcpy(row + DUET_REPLAY_FIELD_PROJ + c0, cx->proj + (r0 + t) * C3 + c0,
                       sizeof(float) * (size_t)nc);
            }
            continue;
        }
        /* concat = window (W-1) ++ inputs (n); the new window is concat[n .. n+W-1) */
        for (int64_t j = 0; j < W - 1; j++) {
            int64_t i = n + j;
            const float *src = i < W - 1 ? hist[i] : cx->proj + (r0 + i - (W - 1)) * C3 + c0;
            for (int64_t ch = 0; ch < nc; ch++)
                win[(c0 + ch) * (W - 1) + j] = src[ch];
        }
    }
}

void duet_cpu_kda_conv(duet_kernels_t *k, const duet_cpu_step_t *st, const duet_cpu_kda_layer_t *ly,
                       const float *taps, const float *proj, float *qkv)
{
    const int64_t C3 = 3 * (int64_t)ly->layout.heads * (int64_t)ly->layout.head_dim;
    duet__kda_conv_ctx_t cx = {.st = st, .ly = ly, .taps = taps, .proj = proj, .qkv = qkv};
    duet_k_parallel_for(k, st->n_items * ((C3 + DUET_CONV_BLOCK - 1) / DUET_CONV_BLOCK), 1,
                        duet__kda_conv_task, &cx);
}

typedef struct {
    int64_t H, K;
    const float *neg_A, *dt_bias;
    float *qkv, *g, *beta;
} duet__kda_prep_ctx_t;

/* Per row: g = -exp(A_log)·softplus(f_b f_a x + dt_bias), β = σ(b x), q,k L2-normalised,
 * q scaled by K^-1/2. */
static void duet__kda_prep_task(void *vctx, int64_t b, int64_t e, int tid)
{
    const duet__kda_prep_ctx_t *cx = vctx;
    const int64_t H = cx->H, K = cx->K, HK = H * K, C3 = 3 * HK;
    const float scale = 1.0f / sqrtf((float)K);

    for (int64_t row = b; row < e; row++) {
        float *g = cx->g + row * HK;
        for (int64_t h = 0; h < H; h++)
            for (int64_t d = 0; d < K; d++) {
                int64_t i = h * K + d;
                g[i] = cx->neg_A[h] * duet__softplus(g[i] + cx->dt_bias[i]);
            }
        float *beta = cx->beta + row * H;
        for (int64_t h = 0; h < H; h++)
            beta[h] = duet__sigmoid(beta[h]);
        for (int64_t part = 0; part < 2; part++) {
            float *v = cx->qkv + row * C3 + part * HK;
            for (int64_t h = 0; h < H; h++) {
                float *x = v + h * K;
                float ss = 0.0f;
                for (int64_t d = 0; d < K; d++)
                    ss += x[d] * x[d];
                float inv = 1.0f / sqrtf(ss + DUET_L2_EPS);
                if (part == 0)
                    inv *= scale;
                for (int64_t d = 0; d < K; d++)
                    x[d] *= inv;
            }
        }
    }
}

void duet_cpu_kda_prep(duet_kernels_t *k, int64_t n_rows, int64_t H, int64_t K, const float *neg_A,
                       const float *dt_bias, float *qkv, float *g, float *beta)
{
    duet__kda_prep_ctx_t cx = {
        .H = H, .K = K, .neg_A = neg_A, .dt_bias = dt_bias, .qkv = qkv, .g = g, .beta = beta};
    duet_k_parallel_for(k, n_rows, 4, duet__kda_prep_task, &cx);
}

typedef struct {
    const duet_cpu_step_t *st;
    const duet_cpu_kda_layer_t *ly;
    const float *qkv, *g, *beta;
    float *o;
    float *scratch;
    int64_t per_thread;
} duet__kda_core_ctx_t;

static void duet__kda_core_task(void *vctx, int64_t b, int64_t e, int tid)
{
    const duet__kda_core_ctx_t *cx = vctx;
    const duet_cpu_step_t *st = cx->st;
    const int64_t H = (int64_t)cx->ly->layout.heads, K = (int64_t)cx->ly->layout.head_dim;
    const int64_t HK = H * K, C3 = 3 * HK;

    for (int64_t idx = b; idx < e; idx++) {
        const int64_t it = idx / H, h = idx % H;
        const int64_t r0 = st->item_row0[it], n = st->item_row0[it + 1] - r0;
        duet_cpu_kda_head_io_t io = {
            .q = cx->qkv + r0 * C3 + h * K,
            .q_stride = C3,
            .k = cx->qkv + r0 * C3 + HK + h * K,
            .k_stride = C3,
            .v = cx->qkv + r0 * C3 + 2 * HK + h * K,
            .v_stride = C3,
            .g = cx->g + r0 * HK + h * K,
            .g_stride = HK,
            .beta = cx->beta + r0 * H + h,
            .beta_stride = H,
            .o = cx->o + r0 * HK + h * K,
            .o_stride = HK,
            .n = n,
            .K = K,
            .V = K,
        };
        float *S = duet__kda_state(cx->ly, st->item_slot[it], h);
        float *scratch = cx->scratch + (int64_t)tid * cx->per_thread;
        if (duet__kda_is_verify(st, it)) {
            /* one row after the other on a copy: the pool keeps the committed state */
            memcpy(scratch, S, sizeof(float) * (size_t)(K * K));
            duet_cpu_kda_recurrent(&io, scratch);
            for (int64_t t = 0; t < n; t++) {
                float *rw = duet__kda_replay_row(cx->ly, st->item_slot[it], t);
                memcpy(rw + DUET_REPLAY_FIELD_K * HK + h * K, io.k + t * C3,
                       sizeof(float) * (size_t)K);
                memcpy(rw + DUET_REPLAY_FIELD_V * HK + h * K, io.v + t * C3,
                       sizeof(float) * (size_t)K);
                memcpy(rw + DUET_REPLAY_FIELD_G * HK + h * K, io.g + t * HK,
                       sizeof(float) * (size_t)K);
                rw[DUET_REPLAY_FIELD_BETA * HK + h] = io.beta[t * H];
            }
        } else if (n == 1) {
            duet_cpu_kda_recurrent(&io, S);
        } else {
            duet_cpu_kda_chunked(&io, S, scratch);
        }
    }
}

void duet_cpu_kda_core(duet_kernels_t *k, const duet_cpu_step_t *st, const duet_cpu_kda_layer_t *ly,
                       const float *qkv, const float *g, const float *beta, float *o,
                       float *scratch, int64_t scratch_per_thread)
{
    duet__kda_core_ctx_t cx = {.st = st,
                               .ly = ly,
                               .qkv = qkv,
                               .g = g,
                               .beta = beta,
                               .o = o,
                               .scratch = scratch,
                               .per_thread = scratch_per_thread};
    duet_k_parallel_for(k, st->n_items * (int64_t)ly->layout.heads, 1, duet__kda_core_task, &cx);
}

typedef struct {
    int64_t H, K;
    const float *o_norm, *gate;
    float eps;
    float *o;
} duet__kda_out_ctx_t;

/* o ← o_norm_w ⊙ o / sqrt(mean(o²) + eps) ⊙ σ(gate), per (row, head). */
static void duet__kda_out_task(void *vctx, int64_t b, int64_t e, int tid)
{
    const duet__kda_out_ctx_t *cx = vctx;
    const int64_t H = cx->H, K = cx->K, HK = H * K;
    const float *w = cx->o_norm;

    for (int64_t row = b; row < e; row++)
        for (int64_t h = 0; h < H; h++) {
            float *o = cx->o + row * HK + h * K;
            const float *gt = cx->gate + row * HK + h * K;
            float ss = 0.0f;
            for (int64_t d = 0; d < K; d++)
                ss += o[d] * o[d];
            float inv = 1.0f / sqrtf(ss / (float)K + cx->eps);
            for (int64_t d = 0; d < K; d++)
                o[d] = w[d] * (o[d] * inv) * duet__sigmoid(gt[d]);
        }
}

void duet_cpu_kda_out(duet_kernels_t *k, int64_t n_rows, int64_t H, int64_t K, const float *o_norm,
                      float eps, const float *gate, float *o)
{
    duet__kda_out_ctx_t cx = {.H = H, .K = K, .o_norm = o_norm, .gate = gate, .eps = eps, .o = o};
    duet_k_parallel_for(k, n_rows, 8, duet__kda_out_task, &cx);
}
