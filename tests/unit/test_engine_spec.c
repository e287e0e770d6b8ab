/*
 * Speculative decoding, the engine's part on the CPU (engine/model.h: verify items,
 * duet_model_seq_accept, the replay-only commit duet_model_seq_commit, duet_model_seq_truncate),
 * on every golden fixture (tests/fixtures) and the demo model (models/duet-demo).
 *
 * The reference is plain decode: the same model run one token per step, which the golden tests
 * check against transformers. A *probe* (a copy of the plain sequence's caches, made with
 * duet_model_seq_set_filled as a cache transfer makes one) decodes a verify item's tokens one per
 * step, giving what each verify row must equal. Bound: 0 (memcmp) everywhere the engine promises
 * bits: verify logits; the KDA state and conv windows after a replay, fused with the next forward
 * or by seq_commit; the KV rows; a mixed batch against each item alone; truncate; and the replay
 * pool's rows: their pre-conv projections against the newest entries of plain decode's conv
 * windows, their k and v against the kernels' conv + prep run sequentially, one row per step on a
 * copy of the committed window, as plain decode runs them, for every KDA layer. A second,
 * independent reference for the first KDA layer's rows (projections, k, v, g, β): this file's own
 * double-precision sequential conv + prep from the checkpoint's embedding, norm and projection
 * weights, max |diff| <= 4e-6 · max(1, max |ref|) per field and row (fp32 against double; what we
 * see is at most 3.5e-7).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend.h"
#include "engine/cache.h"
#include "engine/checkpoint.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "engine/sampler.h"
#include "engine/weights.h"
#include "kernels/cpu/cpu_kda.h"

#include "golden_fixtures.h"
#include "model_step_util.h"
#include "spec_test_util.h"

#define DUET_TEST_RNG_SEED 0x5bec0de5eed1e5ull
#include "test_rng.h"

#define KMAX       4          /* drafts per verify item */
#define SPEC_ROWS  (KMAX + 1) /* the models' spec_rows */
#define STEPS      40         /* speculative steps per model */
#define TAIL       6          /* plain decode steps after the last commit */
#define LAYER0_TOL 4e-6 /* the double-precision layer-0 reference, relative to max(1, |ref|) */
#define MAX_CASES  (MAX_FIXTURES + 1)

/* Every golden fixture, then the demo model (its folder and a prompt; no goldens). */
typedef fixture_t spec_case_t;

static int load_cases(spec_case_t *cs)
{
    int n = load_fixtures(cs, MAX_FIXTURES);
    cr_assert_geq(n, 7, "expected the 7 committed fixtures, found %d", n);
    /* the demo model: its BOS (256) and a line of the corpus, byte-level */
    spec_case_t *d = &cs[n];
    memset(d, 0, sizeof(*d));
    snprintf(d->dir, sizeof(d->dir), "%s/models/duet-demo", DUET_SOURCE_DIR);
    snprintf(d->name, sizeof(d->name), "duet-demo");
    const char *text = "The LORD said unto Moses, ";
    d->n_prompt = 1 + (int64_t)strlen(text);
    d->prompt = malloc(sizeof(int32_t) * (size_t)d->n_prompt);
    d->prompt[0] = 256;
    for (int64_t i = 1; i < d->n_prompt; i++)
        d->prompt[i] = (unsigned char)text[i - 1];
    return n + 1;
}

static void free_cases(spec_case_t *cs, int n)
{
    free_fixtures(cs, n);
}

static duet_model_t *load_spec(const char *dir, int64_t spec_rows)
{
    duet_model_opts_t opts;
    duet_model_opts_default(&opts);
    opts.n_threads = 2;
    opts.max_seqs = 6;
    opts.max_seq_len = 640;
    opts.max_batch_tokens = 512;
    opts.page_tokens = 16; /* verify rows cross pages */
    opts.spec_rows = spec_rows;
    duet_model_t *m = NULL;
    cr_assert_eq(duet_model_load(dir, &opts, &m), DUET_OK, "%s: %s", dir, duet_error_last());
    return m;
}

/* ---- the caches, byte for byte --------------------------------------------------------------- */

static int kda_equal(duet_model_t *m, const duet_seq_t *a, const duet_seq_t *b)
{
    return duet_model_kda_pool(m) == NULL ||
           memcmp(kda_slot(m, a), kda_slot(m, b), kda_slot_bytes(m)) == 0;
}

static const uint8_t *kv_row(duet_model_t *m, const duet_seq_t *s, int64_t layer, int64_t pos)
{
    duet_kv_pool_t *p = duet_model_kv_pool(m);
    const int64_t PT = duet_kv_pool_desc(p)->page_tokens;
    const size_t tb = duet_kv_pool_block_bytes(p) / (size_t)PT;
    return (const uint8_t *)duet_kv_pool_block(p, s->pages[pos / PT], layer) +
           (size_t)(pos % PT) * tb;
}

/* The KV rows of positions [0, n) of every MLA layer. */
static int kv_equal(duet_model_t *m, const duet_seq_t *a, const duet_seq_t *b, int64_t n)
{
    duet_kv_pool_t *p = duet_model_kv_pool(m);
    if (p == NULL)
        return 1;
    const size_t tb = duet_kv_pool_block_bytes(p) / (size_t)duet_kv_pool_desc(p)->page_tokens;
    for (int64_t l = 0; l < duet_kv_pool_desc(p)->n_layers; l++)
        for (int64_t pos = 0; pos < n; pos++)
            if (memcmp(kv_row(m, a, l, pos), kv_row(m, b, l, pos), tb) != 0)
                return 0;
    return 1;
}

/* ---- the independent reference of the first KDA layer's replay rows ------------------------- */

/* The checkpoint's tensors the first layer's conv + prep read, in double. */
typedef struct {
    int64_t D, H, K, W, V;
    double eps;
    double *embed, *norm, *proj[3], *taps[3], *fa, *fb, *dt_bias, *neg_A, *bp;
} layer0_t;

static double *tensor_f64(const duet_tensor_t *t)
{
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++)
        n *= t->shape[d];
    float *f = malloc(sizeof(float) * (size_t)n);
    double *out = malloc(sizeof(double) * (size_t)n);
    duet_convert_to_f32(f, t->data, t->dtype, n);
    for (int64_t i = 0; i < n; i++)
        out[i] = f[i];
    free(f);
    return out;
}

/* 0 when layer 0 is not a KDA layer (no reference then). */
static int layer0_load(const char *dir, layer0_t *r)
{
    duet_model_config_t cfg;
    cr_assert_eq(duet_model_config_load(dir, &cfg), DUET_OK, "%s", duet_error_last());
    if (cfg.mixer[0] != DUET_MIXER_KDA)
        return 0;
    duet_checkpoint_t *ck = NULL;
    duet_weights_t w;
    cr_assert_eq(duet_checkpoint_open(dir, &ck), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_weights_bind(ck, &cfg, &w), DUET_OK, "%s", duet_error_last());
    const duet_kda_weights_t *k = &w.layers[0].kda;
    *r = (layer0_t){.D = cfg.hidden_size,
                    .H = cfg.kda_heads,
                    .K = cfg.kda_head_dim,
                    .W = cfg.conv_kernel,
                    .V = cfg.vocab_size,
                    .eps = cfg.rms_norm_eps};
    r->embed = tensor_f64(&w.embed_tokens);
    r->norm = tensor_f64(&w.layers[0].input_layernorm);
    r->proj[0] = tensor_f64(&k->q_proj);
    r->proj[1] = tensor_f64(&k->k_proj);
    r->proj[2] = tensor_f64(&k->v_proj);
    r->taps[0] = tensor_f64(&k->q_conv);
    r->taps[1] = tensor_f64(&k->k_conv);
    r->taps[2] = tensor_f64(&k->v_conv);
    r->fa = tensor_f64(&k->f_a_proj);
    r->fb = tensor_f64(&k->f_b_proj);
    r->dt_bias = tensor_f64(&k->dt_bias);
    double *a_log = tensor_f64(&k->A_log);
    r->neg_A = malloc(sizeof(double) * (size_t)r->H);
    for (int64_t h = 0; h < r->H; h++)
        r->neg_A[h] = -exp(a_log[h]);
    free(a_log);
    r->bp = tensor_f64(&k->b_proj);
    duet_weights_free(&w);
    duet_checkpoint_close(ck);
    return 1;
}

static void layer0_free(layer0_t *r)
{
    free(r->embed);
    free(r->norm);
    for (int i = 0; i < 3; i++) {
        free(r->proj[i]);
        free(r->taps[i]);
    }
    free(r->fa);
    free(r->fb);
    free(r->dt_bias);
    free(r->neg_A);
    free(r->bp);
}

/* xn = RMSNorm(embed(tok); input_layernorm), layer 0's input. */
static void layer0_xn(const layer0_t *r, int32_t tok, double *xn)
{
    const double *x = r->embed + (int64_t)tok * r->D;
    double ss = 0;
    for (int64_t d = 0; d < r->D; d++)
        ss += x[d] * x[d];
    const double inv = 1.0 / sqrt(ss / (double)r->D + r->eps);
    for (int64_t d = 0; d < r->D; d++)
        xn[d] = r->norm[d] * x[d] * inv;
}

static double dot(const double *a, const double *b, int64_t n)
{
    double s = 0;
    for (int64_t i = 0; i < n; i++)
        s += a[i] * b[i];
    return s;
}

static double max_abs_d(const double *a, int64_t n)
{
    double m = 0;
    for (int64_t i = 0; i < n; i++)
        m = fmax(m, fabs(a[i]));
    return m;
}

/* max |got - ref| / max(1, max |ref|) */
static double rel_err(const float *got, const double *ref, int64_t n)
{
    double m = 0;
    for (int64_t i = 0; i < n; i++)
        m = fmax(m, fabs((double)got[i] - ref[i]));
    return m / fmax(1.0, max_abs_d(ref, n));
}

/*
 * Row `row` of the first KDA layer's replay block against the token at `pos` of `toks`
 * (toks[0..pos] the sequence so far): its pre-conv projections, then a causal conv over the
 * W-1 tokens before it (zeros before the start) + SiLU, k L2-normalised (eps 1e-6 inside the
 * sqrt), g = -exp(A_log)·softplus(f_b f_a xn + dt_bias), β = σ(b xn), all in double from the
 * checkpoint. Returns the largest relative error over the fields.
 */
static double layer0_check_row(const layer0_t *r, const float *row, const int32_t *toks,
                               int64_t pos)
{
    const int64_t D = r->D, H = r->H, K = r->K, HK = H * K, W = r->W;
    double *xn = malloc(sizeof(double) * (size_t)D);
    double *pj = calloc((size_t)(W * 3 * HK), sizeof(double)); /* [W][3*HK], oldest first */
    for (int64_t j = 0; j < W; j++) {
        const int64_t t = pos - (W - 1) + j;
        if (t < 0)
            continue; /* zeros before the start */
        layer0_xn(r, toks[t], xn);
        for (int64_t which = 0; which < 3; which++)
            for (int64_t c = 0; c < HK; c++)
                pj[j * 3 * HK + which * HK + c] = dot(r->proj[which] + c * D, xn, D);
    }
    double err = rel_err(row + DUET_REPLAY_FIELD_PROJ * HK, pj + (W - 1) * 3 * HK, 3 * HK);
    double *conv = malloc(sizeof(double) * (size_t)(3 * HK));
    for (int64_t which = 0; which < 3; which++)
        for (int64_t c = 0; c < HK; c++) {
            double acc = 0;
            for (int64_t j = 0; j < W; j++)
                acc += r->taps[which][c * W + j] * pj[j * 3 * HK + which * HK + c];
            conv[which * HK + c] = acc / (1.0 + exp(-acc));
        }
    for (int64_t h = 0; h < H; h++) { /* k: L2 per head */
        double *kh = conv + HK + h * K;
        const double inv = 1.0 / sqrt(dot(kh, kh, K) + 1e-6);
        for (int64_t d = 0; d < K; d++)
            kh[d] *= inv;
    }
    err = fmax(err, rel_err(row + DUET_REPLAY_FIELD_K * HK, conv + HK, HK));
    err = fmax(err, rel_err(row + DUET_REPLAY_FIELD_V * HK, conv + 2 * HK, HK));
    layer0_xn(r, toks[pos], xn);
    double *fa = malloc(sizeof(double) * (size_t)K), *g = malloc(sizeof(double) * (size_t)HK);
    double *beta = malloc(sizeof(double) * (size_t)H);
    for (int64_t i = 0; i < K; i++)
        fa[i] = dot(r->fa + i * D, xn, D);
    for (int64_t c = 0; c < HK; c++) {
        const double z = dot(r->fb + c * K, fa, K) + r->dt_bias[c];
        g[c] = r->neg_A[c / K] * log1p(exp(z));
    }
    for (int64_t h = 0; h < H; h++)
        beta[h] = 1.0 / (1.0 + exp(-dot(r->bp + h * D, xn, D)));
    err = fmax(err, rel_err(row + DUET_REPLAY_FIELD_G * HK, g, HK));
    err = fmax(err, rel_err(row + DUET_REPLAY_FIELD_BETA * HK, beta, H));
    free(xn);
    free(pj);
    free(conv);
    free(fa);
    free(g);
    free(beta);
    return err;
}

/* ---- the sequential reference of every KDA layer's k and v --------------------------------------
 */

/* The engine's conv + prep run as plain decode runs them, one row per step on a copy of the
 * committed conv window that each step updates, over a verify item's stored projections. */
typedef struct {
    duet_model_config_t cfg;
    duet_checkpoint_t *ck;
    duet_weights_t w;
    duet_backend_f32_t *f32; /* the fp32 taps, dt_bias, -exp(A_log) the backend computes with */
    duet_kernels_t *k;       /* one thread */
    duet_kda_pool_t *pool;   /* one slot, one layer: the window being stepped */
    float *proj, *qkv, *g, *beta;
} seqref_t;

static void seqref_load(const char *dir, seqref_t *r)
{
    memset(r, 0, sizeof(*r));
    cr_assert_eq(duet_model_config_load(dir, &r->cfg), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_checkpoint_open(dir, &r->ck), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_weights_bind(r->ck, &r->cfg, &r->w), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_backend_f32_prepare(&r->cfg, &r->w, &r->f32), DUET_OK);
    cr_assert_eq(duet_kernels_create(DUET_DEVICE_CPU, 1, &r->k), DUET_OK);
    const duet_kda_pool_desc_t d = {.n_slots = 1,
                                    .n_layers = 1,
                                    .heads = r->cfg.kda_heads,
                                    .head_dim = r->cfg.kda_head_dim,
                                    .conv_kernel = r->cfg.conv_kernel};
    cr_assert_eq(duet_kda_pool_create(&d, &r->pool), DUET_OK);
    int32_t slot;
    cr_assert_eq(duet_kda_pool_alloc(r->pool, &slot), DUET_OK);
    cr_assert_eq(slot, 0);
    const int64_t HK = r->cfg.kda_heads * r->cfg.kda_head_dim;
    r->proj = malloc(sizeof(float) * (size_t)(3 * HK));
    r->qkv = malloc(sizeof(float) * (size_t)(3 * HK));
    r->g = malloc(sizeof(float) * (size_t)HK);
    r->beta = malloc(sizeof(float) * (size_t)r->cfg.kda_heads);
}

static void seqref_free(seqref_t *r)
{
    free(r->proj);
    free(r->qkv);
    free(r->g);
    free(r->beta);
    duet_kda_pool_destroy(r->pool);
    duet_kernels_destroy(r->k);
    duet_backend_f32_free(&r->cfg, r->f32);
    duet_weights_free(&r->w);
    duet_checkpoint_close(r->ck);
}

/* Rows 0..n of every KDA layer's replay block: k and v bit for bit as the sequential steps give
 * them. The sequence's conv windows are the committed ones (a verify leaves them). */
static void check_replay_kv_sequential(seqref_t *r, duet_model_t *m, const duet_seq_t *spec,
                                       int64_t n, const char *name, int s)
{
    duet_kda_pool_t *kp = duet_model_kda_pool(m);
    duet_replay_pool_t *rp = duet_model_replay_pool(m);
    const int64_t H = r->cfg.kda_heads, K = r->cfg.kda_head_dim, HK = H * K;
    const size_t win_bytes = sizeof(float) * (size_t)(3 * HK * (r->cfg.conv_kernel - 1));
    const int64_t row0[2] = {0, 1}, pos0 = 0;
    const int32_t slot0 = 0;
    const duet_cpu_step_t st = {
        .n_items = 1, .n_rows = 1, .item_row0 = row0, .item_pos0 = &pos0, .item_slot = &slot0};
    const duet_cpu_kda_layer_t ly = {.kda_base = duet_kda_pool_base(r->pool),
                                     .layout = duet_kda_pool_layout(r->pool),
                                     .layer = 0};
    for (int64_t l = 0, sub = 0; l < r->cfg.num_layers; l++) {
        if (r->cfg.mixer[l] != DUET_MIXER_KDA)
            continue;
        memcpy(duet_kda_pool_conv(r->pool, 0, 0), duet_kda_pool_conv(kp, spec->kda_slot, sub),
               win_bytes);
        for (int64_t j = 0; j < n; j++) {
            const float *row = duet_replay_pool_row(rp, spec->kda_slot, sub, j);
            memcpy(r->proj, row + DUET_REPLAY_FIELD_PROJ * HK, sizeof(float) * (size_t)(3 * HK));
            memset(r->g, 0, sizeof(float) * (size_t)HK);
            memset(r->beta, 0, sizeof(float) * (size_t)H);
            duet_cpu_kda_conv(r->k, &st, &ly, r->f32[l].conv_w, r->proj, r->qkv);
            duet_cpu_kda_prep(r->k, 1, H, K, r->f32[l].neg_A, r->f32[l].dt_bias, r->qkv, r->g,
                              r->beta);
            cr_assert(memcmp(row + DUET_REPLAY_FIELD_K * HK, r->qkv + HK,
                             sizeof(float) * (size_t)HK) == 0,
                      "%s step %d: replay row %lld of KDA layer %lld: k differs from the "
                      "sequential conv + prep",
                      name, s, (long long)j, (long long)sub);
            cr_assert(memcmp(row + DUET_REPLAY_FIELD_V * HK, r->qkv + 2 * HK,
                             sizeof(float) * (size_t)HK) == 0,
                      "%s step %d: replay row %lld of KDA layer %lld: v differs from the "
                      "sequential conv + prep",
                      name, s, (long long)j, (long long)sub);
        }
        sub++;
    }
}

/* ---- speculation against plain decode -------------------------------------------------------- */

typedef struct {
    int64_t verifies, rows, fused_replays, commits, layer0_rows;
    double layer0_err;
} spec_stats_t;

/*
 * The pre-conv projections in the replay pool against plain decode's own: after a probe's
 * one-token step of verify row j, the newest entry of every conv window is that row's projection.
 * wins[j] holds the probe's KDA slot after row j.
 */
static void check_replay_proj(duet_model_t *m, const duet_seq_t *spec, uint8_t **wins, int64_t n,
                              const char *name)
{
    duet_kda_pool_t *kp = duet_model_kda_pool(m);
    duet_replay_pool_t *rp = duet_model_replay_pool(m);
    if (kp == NULL)
        return;
    cr_assert_not_null(rp);
    const duet_kda_pool_desc_t *d = duet_kda_pool_desc(kp);
    const int64_t HK = d->heads * d->head_dim, W1 = d->conv_kernel - 1;
    const size_t lb = duet_kda_pool_layer_bytes(kp);
    for (int64_t l = 0; l < d->n_layers; l++)
        for (int64_t j = 0; j < n; j++) {
            const float *win =
                (const float *)(wins[j] + (size_t)l * lb +
                                ((const uint8_t *)duet_kda_pool_conv(kp, spec->kda_slot, l) -
                                 (const uint8_t *)duet_kda_pool_state(kp, spec->kda_slot, l)));
            const float *row = duet_replay_pool_row(rp, spec->kda_slot, l, j);
            for (int64_t c = 0; c < 3 * HK; c++)
                cr_assert(memcmp(&row[DUET_REPLAY_FIELD_PROJ * HK + c], &win[c * W1 + W1 - 1],
                                 sizeof(float)) == 0,
                          "%s: replay row %lld of KDA layer %lld: projection %lld differs from "
                          "plain decode's conv window",
                          name, (long long)j, (long long)l, (long long)c);
        }
}

static void run_spec_case(const spec_case_t *cs, spec_stats_t *stats)
{
    duet_model_t *m = load_spec(cs->dir, SPEC_ROWS);
    const int64_t V = duet_model_config(m)->vocab_size, P = cs->n_prompt;
    const int64_t cap = P + STEPS * SPEC_ROWS + TAIL + KMAX;
    layer0_t l0;
    const int have_l0 = layer0_load(cs->dir, &l0);
    seqref_t sq;
    const int have_kda = duet_model_kda_pool(m) != NULL;
    if (have_kda)
        seqref_load(cs->dir, &sq);
    int32_t *hist = malloc(sizeof(int32_t) * (size_t)(cap + SPEC_ROWS)); /* the tokens so far */
    memcpy(hist, cs->prompt, sizeof(int32_t) * (size_t)P);
    float *lg = malloc(sizeof(float) * (size_t)(P * V));
    float *vl = malloc(sizeof(float) * (size_t)(SPEC_ROWS * V));
    float *pl = malloc(sizeof(float) * (size_t)(SPEC_ROWS * V));
    float *rl = malloc(sizeof(float) * (size_t)(SPEC_ROWS * V));
    uint8_t *wins[SPEC_ROWS];
    for (int j = 0; j < SPEC_ROWS; j++)
        wins[j] = malloc(kda_slot_bytes(m) + 1);

    /* plain: the reference; spec: the same caches (a transfer's copy), then speculation */
    duet_seq_t ref, spec, probe;
    cr_assert_eq(duet_model_seq_open(m, cap, &ref), DUET_OK);
    step(m, &ref, cs->prompt, P, 0, lg);
    clone_seq(m, &ref, cap, &spec);
    int32_t next = duet_argmax(lg + (P - 1) * V, V);
    for (int s = 0; s < STEPS; s++) {
        const int64_t n0 = ref.n_tokens;
        const uint32_t action = rng_u32() % 8;
        if (action < 2) {
            /* a plain step on both (one token, or a chunk): spec's pending replay is fused */
            const int64_t n = action == 0 ? 1 : 2 + rng_u32() % 4;
            int32_t toks[8] = {next};
            for (int64_t j = 1; j < n; j++)
                toks[j] = (int32_t)(rng_u32() % (uint32_t)V);
            const int64_t had_replay = spec.n_replay;
            step(m, &spec, toks, n, 0, vl);
            step(m, &ref, toks, n, 0, rl);
            cr_assert(memcmp(vl, rl, sizeof(float) * (size_t)(n * V)) == 0,
                      "%s step %d: a plain step after a replay differs from plain decode", cs->name,
                      s);
            cr_assert(spec.n_replay == 0 && spec.n_tokens == ref.n_tokens);
            cr_assert(kda_equal(m, &spec, &ref),
                      "%s step %d: the state after a fused replay (%lld rows) and a %lld-row "
                      "step differs from plain decode's",
                      cs->name, s, (long long)had_replay, (long long)n);
            stats->fused_replays += had_replay > 0;
            memcpy(hist + n0, toks, sizeof(int32_t) * (size_t)n);
            next = duet_argmax(vl + (n - 1) * V, V);
            continue;
        }
        if ((action == 2 || action == 3) && spec.n_replay > 0) {
            cr_assert_eq(duet_model_seq_commit(m, &spec), DUET_OK, "%s", duet_error_last());
            cr_assert_eq(spec.n_replay, 0);
            cr_assert(kda_equal(m, &spec, &ref),
                      "%s step %d: the state after seq_commit differs from plain decode's",
                      cs->name, s);
            stats->commits++;
        }
        /* a verify item: the next token and k drafts */
        const int64_t k = 1 + rng_u32() % KMAX, n = k + 1;
        int32_t rows[SPEC_ROWS] = {next};
        for (int64_t j = 1; j < n; j++)
            rows[j] = (int32_t)(rng_u32() % (uint32_t)V);
        memcpy(hist + n0, rows, sizeof(int32_t) * (size_t)n);
        /* what plain decode gives each row: a probe copy decodes them one per step */
        clone_seq(m, &ref, cap, &probe);
        for (int64_t j = 0; j < n; j++) {
            step(m, &probe, &rows[j], 1, 0, pl + j * V);
            if (duet_model_kda_pool(m) != NULL)
                memcpy(wins[j], kda_slot(m, &probe), kda_slot_bytes(m));
        }
        duet_model_seq_close(m, &probe);

        const int64_t had_replay = spec.n_replay;
        step(m, &spec, rows, n, 1, vl);
        cr_assert(spec.n_pending == n && spec.n_tokens == n0 && spec.n_replay == 0);
        for (int64_t j = 0; j < n; j++)
            cr_assert(memcmp(vl + j * V, pl + j * V, sizeof(float) * (size_t)V) == 0,
                      "%s step %d: verify row %lld of %lld: logits differ from plain decode's",
                      cs->name, s, (long long)j, (long long)n);
        /* the verify left the committed state (after its fused replay) as plain decode's */
        cr_assert(kda_equal(m, &spec, &ref),
                  "%s step %d: the state after a verify (fused replay of %lld rows) differs "
                  "from plain decode's",
                  cs->name, s, (long long)had_replay);
        cr_assert(kv_equal(m, &spec, &ref, n0), "%s step %d: committed KV rows differ", cs->name,
                  s);
        stats->fused_replays += had_replay > 0;
        check_replay_proj(m, &spec, wins, n, cs->name);
        if (have_kda)
            check_replay_kv_sequential(&sq, m, &spec, n, cs->name, s);
        if (have_l0)
            for (int64_t j = 0; j < n; j++) {
                const float *row =
                    duet_replay_pool_row(duet_model_replay_pool(m), spec.kda_slot, 0, j);
                const double e = layer0_check_row(&l0, row, hist, n0 + j);
                stats->layer0_err = fmax(stats->layer0_err, e);
                stats->layer0_rows++;
                cr_assert_leq(e, LAYER0_TOL,
                              "%s step %d: replay row %lld of KDA layer 0 is %g from the "
                              "double-precision conv + prep",
                              cs->name, s, (long long)j, e);
            }
        stats->verifies++;
        stats->rows += n;

        const int64_t acc = 1 + rng_u32() % (uint32_t)n;
        cr_assert_eq(duet_model_seq_accept(m, &spec, acc), DUET_OK, "%s", duet_error_last());
        cr_assert(spec.n_tokens == n0 + acc && spec.n_pending == 0);
        cr_assert_eq(spec.n_replay, duet_model_kda_pool(m) != NULL ? acc : 0);
        for (int64_t j = 0; j < acc; j++)
            step(m, &ref, &rows[j], 1, 0, rl);
        next = duet_argmax(vl + (acc - 1) * V, V);
    }
    /* replay-only commit, then plain decode on both: as if it never speculated */
    stats->commits += spec.n_replay > 0;
    cr_assert_eq(duet_model_seq_commit(m, &spec), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_model_seq_commit(m, &spec), DUET_OK, "a second commit is a no-op");
    cr_assert(kda_equal(m, &spec, &ref), "%s: the state after the last commit differs", cs->name);
    for (int t = 0; t < TAIL; t++) {
        step(m, &spec, &next, 1, 0, vl);
        step(m, &ref, &next, 1, 0, rl);
        cr_assert(memcmp(vl, rl, sizeof(float) * (size_t)V) == 0,
                  "%s: plain decode step %d after speculation differs from never speculating",
                  cs->name, t);
        next = duet_argmax(vl, V);
    }
    cr_assert_eq(spec.n_tokens, ref.n_tokens);
    cr_assert(kda_equal(m, &spec, &ref), "%s: final KDA state differs", cs->name);
    cr_assert(kv_equal(m, &spec, &ref, ref.n_tokens), "%s: final KV rows differ", cs->name);
    duet_model_seq_close(m, &spec);
    duet_model_seq_close(m, &ref);
    if (have_l0)
        layer0_free(&l0);
    if (have_kda)
        seqref_free(&sq);
    for (int j = 0; j < SPEC_ROWS; j++)
        free(wins[j]);
    free(hist);
    free(lg);
    free(vl);
    free(pl);
    free(rl);
    duet_model_free(m);
}

Test(engine_spec, verify_accept_replay_equal_plain_decode, .timeout = 600)
{
    spec_case_t cs[MAX_CASES];
    const int n = load_cases(cs);
    int n_l0 = 0;
    for (int i = 0; i < n; i++) {
        spec_stats_t st = {0};
        run_spec_case(&cs[i], &st);
        printf("spec %-30s %2lld verify items (%3lld rows), %2lld fused replays, %2lld commits: "
               "bit-identical to plain decode; layer-0 replay rows vs double: %lld rows, "
               "max rel %.3g\n",
               cs[i].name, (long long)st.verifies, (long long)st.rows, (long long)st.fused_replays,
               (long long)st.commits, (long long)st.layer0_rows, st.layer0_err);
        cr_expect_gt(st.verifies, 0);
        cr_expect_gt(st.fused_replays, 0, "%s: no replay was fused with a forward", cs[i].name);
        n_l0 += st.layer0_rows > 0;
    }
    cr_expect_geq(n_l0, 5, "the layer-0 reference ran on %d models", n_l0);
    free_cases(cs, n);
}

/* ---- a mixed batch --------------------------------------------------------------------------- */

/* What one sequence of the mixed batch leaves behind, to compare between the two passes. */
typedef struct {
    float *logits;
    uint8_t *kda;
    uint8_t *replay; /* the first n_pending rows of every KDA layer */
    size_t replay_bytes;
    uint8_t *kv; /* KV rows [0, n_tokens + n_pending) of every MLA layer */
    size_t kv_bytes;
    int64_t n_tokens, n_pending, n_replay;
} seq_out_t;

#define MIX 5

static void snapshot(duet_model_t *m, const duet_seq_t *s, seq_out_t *o)
{
    o->n_tokens = s->n_tokens;
    o->n_pending = s->n_pending;
    o->n_replay = s->n_replay;
    if (duet_model_kda_pool(m) != NULL) {
        o->kda = malloc(kda_slot_bytes(m));
        memcpy(o->kda, kda_slot(m, s), kda_slot_bytes(m));
        duet_replay_pool_t *rp = duet_model_replay_pool(m);
        const duet_replay_pool_desc_t *d = duet_replay_pool_desc(rp);
        const duet_replay_layout_t rl = duet_replay_pool_layout(rp);
        uint64_t rb64 = 0;
        cr_assert(duet_replay_layout_row_bytes(&rl, &rb64));
        const size_t rb = (size_t)rb64;
        o->replay_bytes = rb * (size_t)(s->n_pending * d->n_layers);
        o->replay = malloc(o->replay_bytes + 1);
        for (int64_t l = 0; l < d->n_layers; l++)
            for (int64_t j = 0; j < s->n_pending; j++)
                memcpy(o->replay + (size_t)(l * s->n_pending + j) * rb,
                       duet_replay_pool_row(rp, s->kda_slot, l, j), rb);
    }
    duet_kv_pool_t *kv = duet_model_kv_pool(m);
    if (kv != NULL) {
        const int64_t n = s->n_tokens + s->n_pending, L = duet_kv_pool_desc(kv)->n_layers;
        const size_t tb = duet_kv_pool_block_bytes(kv) / (size_t)duet_kv_pool_desc(kv)->page_tokens;
        o->kv_bytes = tb * (size_t)(n * L);
        o->kv = malloc(o->kv_bytes + 1);
        for (int64_t l = 0; l < L; l++)
            for (int64_t pos = 0; pos < n; pos++)
                memcpy(o->kv + (size_t)(l * n + pos) * tb, kv_row(m, s, l, pos), tb);
    }
}

static void free_out(seq_out_t *o)
{
    free(o->logits);
    free(o->kda);
    free(o->replay);
    free(o->kv);
}

/*
 * Five sequences: 0 a prefill chunk, 1 a plain decode row with a replay to fuse, 2 a plain
 * decode row, 3 a verify item of k = 1 with a replay to fuse, 4 a verify item of k = KMAX. Pass 0
 * runs them as one batch, pass 1 each alone (last first).
 */
static void mixed_pass(duet_model_t *m, const spec_case_t *cs, int pass, seq_out_t *out)
{
    const int64_t V = duet_model_config(m)->vocab_size, P = cs->n_prompt;
    const int64_t pre[MIX] = {P / 4, P / 2, P / 3, P / 2 + 1, P - 2};
    const int64_t len[MIX] = {P / 2, 1, 1, 2, KMAX + 1};
    const int verify[MIX] = {0, 0, 0, 1, 1};
    float *scratch = malloc(sizeof(float) * (size_t)((P + SPEC_ROWS) * V));
    int32_t toks[MIX][640];
    duet_seq_t s[MIX];
    duet_batch_item_t items[MIX];
    uint64_t saved = rng_state;
    rng_state = 0x1234567ull; /* both passes draw the same tokens */
    for (int i = 0; i < MIX; i++) {
        cr_assert_eq(duet_model_seq_open(m, P + 4 * SPEC_ROWS, &s[i]), DUET_OK);
        memcpy(toks[i], cs->prompt, sizeof(int32_t) * (size_t)pre[i]);
        step(m, &s[i], toks[i], pre[i], 0, scratch);
        if (i == 1 || i == 3) { /* a verify + accept before: rows to replay */
            int32_t r[3];
            for (int j = 0; j < 3; j++)
                r[j] = (int32_t)(rng_u32() % (uint32_t)V);
            step(m, &s[i], r, 3, 1, scratch);
            cr_assert_eq(duet_model_seq_accept(m, &s[i], 2), DUET_OK);
        }
        for (int64_t j = 0; j < len[i]; j++)
            toks[i][j] = (int32_t)(rng_u32() % (uint32_t)V);
        out[i].logits = malloc(sizeof(float) * (size_t)(len[i] * V));
        items[i] = (duet_batch_item_t){.seq = &s[i],
                                       .tokens = toks[i],
                                       .n_tokens = len[i],
                                       .logits_mode = DUET_LOGITS_ALL,
                                       .logits = out[i].logits,
                                       .verify = verify[i]};
    }
    rng_state = saved;
    if (duet_model_kda_pool(m) != NULL)
        cr_assert(s[1].n_replay == 2 && s[3].n_replay == 2, "replays are set up");
    if (pass == 0) {
        cr_assert_eq(duet_model_forward(m, items, MIX), DUET_OK, "%s", duet_error_last());
    } else {
        for (int i = MIX - 1; i >= 0; i--)
            cr_assert_eq(duet_model_forward(m, &items[i], 1), DUET_OK, "%s", duet_error_last());
    }
    for (int i = 0; i < MIX; i++) {
        snapshot(m, &s[i], &out[i]);
        duet_model_seq_close(m, &s[i]);
    }
    free(scratch);
}

Test(engine_spec, mixed_batch_bit_identical_to_alone, .timeout = 600)
{
    spec_case_t cs[MAX_CASES];
    const int n = load_cases(cs);
    static const char *const what[MIX] = {"prefill chunk", "decode row after a replay",
                                          "decode row", "verify k=1 after a replay",
                                          "verify k=KMAX"};
    for (int c = 0; c < n; c++) {
        duet_model_t *m = load_spec(cs[c].dir, SPEC_ROWS);
        const int64_t V = duet_model_config(m)->vocab_size;
        seq_out_t o[2][MIX];
        memset(o, 0, sizeof(o));
        mixed_pass(m, &cs[c], 0, o[0]);
        mixed_pass(m, &cs[c], 1, o[1]);
        const int64_t len[MIX] = {cs[c].n_prompt / 2, 1, 1, 2, KMAX + 1};
        for (int i = 0; i < MIX; i++) {
            seq_out_t *a = &o[0][i], *b = &o[1][i];
            cr_assert(a->n_tokens == b->n_tokens && a->n_pending == b->n_pending &&
                      a->n_replay == 0 && b->n_replay == 0);
            cr_expect(memcmp(a->logits, b->logits, sizeof(float) * (size_t)(len[i] * V)) == 0,
                      "%s: %s: logits in the batch differ from alone", cs[c].name, what[i]);
            cr_expect(a->kda == NULL || memcmp(a->kda, b->kda, kda_slot_bytes(m)) == 0,
                      "%s: %s: KDA state in the batch differs from alone", cs[c].name, what[i]);
            cr_expect(a->replay_bytes == b->replay_bytes &&
                          (a->replay == NULL || memcmp(a->replay, b->replay, a->replay_bytes) == 0),
                      "%s: %s: replay rows in the batch differ from alone", cs[c].name, what[i]);
            cr_expect(a->kv_bytes == b->kv_bytes &&
                          (a->kv == NULL || memcmp(a->kv, b->kv, a->kv_bytes) == 0),
                      "%s: %s: KV rows in the batch differ from alone", cs[c].name, what[i]);
            free_out(a);
            free_out(b);
        }
        printf("spec %-30s mixed batch (prefill chunk, decode rows, verify k=1 and k=%d, two "
               "fused replays): bit-identical to each alone\n",
               cs[c].name, KMAX);
        duet_model_free(m);
    }
    free_cases(cs, n);
}

/* ---- an MLA-only model: truncate ------------------------------------------------------------- */

/* The one-layer MLA-only model: mla-first-bf16-mixed-norenorm's layer 0 (MLA, dense MLP) cut out
 * (spec_test_util.h). Returns the folder (in /tmp). */
static void make_mla_only(char *dir, size_t cap)
{
    char src[1600];
    snprintf(src, sizeof(src), "%s/tests/fixtures/mla-first-bf16-mixed-norenorm", DUET_SOURCE_DIR);
    mla_only_make(src, dir, cap);
}

Test(engine_spec, truncate_on_mla_only_equals_never_running_the_tokens, .timeout = 300)
{
    char dir[64];
    make_mla_only(dir, sizeof(dir));
    duet_model_t *m = load_spec(dir, SPEC_ROWS);
    cr_assert_null(duet_model_kda_pool(m));
    cr_assert_null(duet_model_replay_pool(m), "no KDA layers: no replay pool");
    const int64_t V = duet_model_config(m)->vocab_size, P = 40;
    int32_t toks[P + 16];
    for (int64_t i = 0; i < P + 16; i++)
        toks[i] = (int32_t)(rng_u32() % (uint32_t)V);
    float *lg = malloc(sizeof(float) * (size_t)(P * V));
    float *la = malloc(sizeof(float) * (size_t)(SPEC_ROWS * V));
    float *lb = malloc(sizeof(float) * (size_t)(SPEC_ROWS * V));
    int n_checked = 0;
    for (int trial = 0; trial < 8; trial++) {
        /* a: P tokens, then d drafts one per step (a drafter), rolled back to keep; b never ran
         * the dropped ones. Then both take the same 3 tokens. */
        const int64_t d = 1 + rng_u32() % 6, keep = rng_u32() % (uint32_t)(d + 1);
        int32_t drafts[8], after[3];
        for (int64_t j = 0; j < d; j++)
            drafts[j] = (int32_t)(rng_u32() % (uint32_t)V);
        for (int j = 0; j < 3; j++)
            after[j] = (int32_t)(rng_u32() % (uint32_t)V);
        duet_seq_t a, b;
        cr_assert_eq(duet_model_seq_open(m, P + 16, &a), DUET_OK);
        cr_assert_eq(duet_model_seq_open(m, P + 16, &b), DUET_OK);
        step(m, &a, toks, P, 0, lg);
        step(m, &b, toks, P, 0, lg);
        for (int64_t j = 0; j < d; j++)
            step(m, &a, &drafts[j], 1, 0, la);
        cr_assert_eq(duet_model_seq_truncate(m, &a, P + keep, NULL), DUET_OK, "%s",
                     duet_error_last());
        cr_assert_eq(a.n_tokens, P + keep);
        for (int64_t j = 0; j < keep; j++)
            step(m, &b, &drafts[j], 1, 0, lb);
        for (int j = 0; j < 3; j++) {
            step(m, &a, &after[j], 1, 0, la);
            step(m, &b, &after[j], 1, 0, lb);
            cr_assert(memcmp(la, lb, sizeof(float) * (size_t)V) == 0,
                      "trial %d: after truncating %lld of %lld drafts, step %d differs", trial,
                      (long long)(d - keep), (long long)d, j);
            n_checked++;
        }
        cr_assert(kv_equal(m, &a, &b, a.n_tokens));
        /* verify on an MLA-only model: rows as plain decode, accept keeps a prefix, nothing to
         * replay; truncate drops pending rows */
        int32_t rows[3] = {after[0], drafts[0], after[1]};
        step(m, &a, rows, 3, 1, la);
        for (int j = 0; j < 3; j++) {
            step(m, &b, &rows[j], 1, 0, lb);
            cr_assert(memcmp(la + j * V, lb, sizeof(float) * (size_t)V) == 0,
                      "MLA-only verify row %d differs from plain decode", j);
        }
        cr_assert_eq(duet_model_seq_accept(m, &a, 3), DUET_OK);
        cr_assert(a.n_tokens == b.n_tokens && a.n_replay == 0);
        step(m, &a, rows, 2, 1, la);
        cr_assert_eq(duet_model_seq_truncate(m, &a, a.n_tokens - 1, NULL), DUET_OK);
        cr_assert(a.n_pending == 0 && a.n_tokens == b.n_tokens - 1);
        duet_model_seq_close(m, &a);
        duet_model_seq_close(m, &b);
    }
    printf("spec truncate on an MLA-only model: %d steps after a rollback bit-identical to never "
           "running the dropped tokens\n",
           n_checked);
    free(lg);
    free(la);
    free(lb);
    duet_model_free(m);
    mla_only_remove(dir);
}

/* ---- a drafter with KDA layers: state save, restore, truncate -------------------------------- */

/*
 * A drafter's rollback (model.h: duet_model_seq_state_save, duet_model_seq_truncate with the saved
 * state) on every model with KDA layers, loaded as a drafter is (no spec_rows): a runs P tokens,
 * saves, runs d drafts (one per step, or one chunk), rolls back to P; b never ran them. Then both
 * take the same kept drafts and 3 more tokens: bound 0 (memcmp) on the KDA state right after the
 * rollback, on every later step's logits, the KDA state and the KV rows. And the saved copy, put
 * into a fresh sequence beside a copy of the KV pages (duet_model_seq_state_restore +
 * duet_model_seq_set_filled, a resume), continues as b does.
 */
Test(engine_spec, state_restore_rollback_equals_never_running_the_tokens, .timeout = 600)
{
    spec_case_t cs[MAX_CASES];
    const int n = load_cases(cs);
    int n_models = 0;
    for (int c = 0; c < n; c++) {
        duet_model_t *m = load_spec(cs[c].dir, 0);
        if (duet_model_kda_pool(m) == NULL) {
            duet_model_free(m);
            continue;
        }
        n_models++;
        cr_assert_eq(duet_model_seq_state_bytes(m), kda_slot_bytes(m),
                     "%s: a state copy is one KDA slot, every layer's S and conv windows",
                     cs[c].name);
        const int64_t V = duet_model_config(m)->vocab_size, P = 24;
        uint8_t *saved = malloc(duet_model_seq_state_bytes(m));
        float *lg = malloc(sizeof(float) * (size_t)(P * V));
        float *la = malloc(sizeof(float) * (size_t)(16 * V));
        float *lb = malloc(sizeof(float) * (size_t)(16 * V));
        for (int trial = 0; trial < 4; trial++) {
            int32_t toks[P], drafts[8], after[3];
            for (int64_t i = 0; i < P; i++)
                toks[i] = (int32_t)(rng_u32() % (uint32_t)V);
            const int64_t d = 1 + rng_u32() % 7, keep = rng_u32() % (uint32_t)(d + 1);
            for (int64_t j = 0; j < d; j++)
                drafts[j] = (int32_t)(rng_u32() % (uint32_t)V);
            for (int j = 0; j < 3; j++)
                after[j] = (int32_t)(rng_u32() % (uint32_t)V);
            duet_seq_t a, b, r;
            cr_assert_eq(duet_model_seq_open(m, P + 16, &a), DUET_OK);
            cr_assert_eq(duet_model_seq_open(m, P + 16, &b), DUET_OK);
            step(m, &a, toks, P, 0, lg);
            step(m, &b, toks, P, 0, lg);
            cr_assert_eq(duet_model_seq_state_save(m, &a, saved), DUET_OK, "%s", duet_error_last());
            cr_assert(memcmp(saved, kda_slot(m, &a), kda_slot_bytes(m)) == 0,
                      "%s: the saved copy is the slot", cs[c].name);
            if (trial % 2 == 0)
                for (int64_t j = 0; j < d; j++)
                    step(m, &a, &drafts[j], 1, 0, la);
            else
                step(m, &a, drafts, d, 0, la);
            cr_assert(!kda_equal(m, &a, &b), "%s: the drafts changed the state", cs[c].name);
            cr_assert_eq(duet_model_seq_truncate(m, &a, P, saved), DUET_OK, "%s",
                         duet_error_last());
            cr_assert(a.n_tokens == P && a.n_pending == 0 && a.n_replay == 0);
            cr_assert(kda_equal(m, &a, &b),
                      "%s trial %d: the KDA state after the rollback "
                      "differs from never running the drafts",
                      cs[c].name, trial);
            /* a resume: the saved state and the KV pages in a fresh sequence */
            cr_assert_eq(duet_model_seq_open(m, P + 16, &r), DUET_OK);
            duet_kv_pool_t *kv = duet_model_kv_pool(m);
            if (kv != NULL)
                for (int64_t pg = 0; pg < r.n_pages; pg++)
                    for (int64_t l = 0; l < duet_kv_pool_desc(kv)->n_layers; l++)
                        memcpy(duet_kv_pool_block(kv, r.pages[pg], l),
                               duet_kv_pool_block(kv, b.pages[pg], l),
                               duet_kv_pool_block_bytes(kv));
            cr_assert_eq(duet_model_seq_state_restore(m, &r, saved), DUET_OK, "%s",
                         duet_error_last());
            cr_assert_eq(duet_model_seq_set_filled(m, &r, P), DUET_OK, "%s", duet_error_last());
            cr_assert(kda_equal(m, &r, &b), "%s: the restored state is the saved one", cs[c].name);
            /* the kept drafts and 3 more tokens, the way the drafter's catch-up runs them: one
             * chunk, then one token per step */
            int32_t cont[8 + 3];
            memcpy(cont, drafts, sizeof(*drafts) * (size_t)keep);
            memcpy(cont + keep, after, sizeof(after));
            duet_seq_t *seqs[3] = {&a, &b, &r};
            float *rb = malloc(sizeof(float) * (size_t)(16 * V));
            for (int x = 0; x < 3; x++) {
                float *out = x == 0 ? la : x == 1 ? lb : rb;
                step(m, seqs[x], cont, keep + 1, 0, out);
                for (int j = 1; j < 3; j++)
                    step(m, seqs[x], &cont[keep + j], 1, 0, out + (keep + j) * V);
            }
            for (int x = 0; x < 3; x += 2) {
                const float *out = x == 0 ? la : rb;
                cr_assert(memcmp(out, lb, sizeof(float) * (size_t)((keep + 3) * V)) == 0,
                          "%s trial %d (%s, %lld of %lld drafts kept): logits after the %s "
                          "differ from never running the drafts",
                          cs[c].name, trial, trial % 2 == 0 ? "drafts one per step" : "one chunk",
                          (long long)keep, (long long)d, x == 0 ? "rollback" : "resume");
                cr_assert(kda_equal(m, seqs[x], &b) && kv_equal(m, seqs[x], &b, b.n_tokens),
                          "%s trial %d: caches after the %s differ", cs[c].name, trial,
                          x == 0 ? "rollback" : "resume");
            }
            free(rb);
            duet_model_seq_close(m, &a);
            duet_model_seq_close(m, &b);
            duet_model_seq_close(m, &r);
        }
        printf("spec %-30s drafter rollback (state save, drafts, truncate with the state) and "
               "resume: KDA state, KV and logits bit-identical to never running the drafts\n",
               cs[c].name);
        free(saved);
        free(lg);
        free(la);
        free(lb);
        duet_model_free(m);
    }
    cr_assert_geq(n_models, 2, "expected fixtures with KDA layers and the demo model");
    free_cases(cs, n);
}

/* ---- suspend and resume ---------------------------------------------------------------------- */

/*
 * A generation worker out of pages suspends a request: snapshot (replay-only commit, KV pages and
 * KDA state to a host buffer), close, and later open, restore, continue. Reference: the same
 * tokens in a sequence never suspended. The suspended sequence is opened small and grown page by
 * page (duet_model_seq_grow) as a worker grows it, and restored into other pages than it had. Half
 * the trials suspend right after an accepted verify, with rows not yet folded into the KDA state
 * (the snapshot's commit folds them; the reference folds them at its next forward). Bound: 0.
 */
Test(engine_spec, suspend_resume_equals_never_suspending, .timeout = 600)
{
    spec_case_t cs[MAX_CASES];
    const int n = load_cases(cs);
    int with_replay = 0;
    for (int c = 0; c < n; c++) {
        duet_model_t *m = load_spec(cs[c].dir, SPEC_ROWS);
        duet_kv_pool_t *kv = duet_model_kv_pool(m);
        const int64_t free0 = kv != NULL ? duet_kv_pool_n_free(kv) : 0;
        const int64_t V = duet_model_config(m)->vocab_size, P = 21, CONT = 6;
        float *lg = malloc(sizeof(float) * (size_t)(P * V));
        float *la = malloc(sizeof(float) * (size_t)(CONT * V));
        float *lb = malloc(sizeof(float) * (size_t)(CONT * V));
        for (int trial = 0; trial < 4; trial++) {
            int32_t toks[P], drafts[KMAX + 1], cont[CONT];
            for (int64_t i = 0; i < P; i++)
                toks[i] = (int32_t)(rng_u32() % (uint32_t)V);
            for (int j = 0; j <= KMAX; j++)
                drafts[j] = (int32_t)(rng_u32() % (uint32_t)V);
            for (int j = 0; j < CONT; j++)
                cont[j] = (int32_t)(rng_u32() % (uint32_t)V);
            const int verify = trial % 2 == 0;
            const int64_t keep = 1 + rng_u32() % KMAX;
            duet_seq_t a, s, r, hole;
            cr_assert_eq(duet_model_seq_open(m, P + 64, &a), DUET_OK);
            cr_assert_eq(duet_model_seq_open(m, P, &s), DUET_OK, "%s", duet_error_last());
            step(m, &a, toks, P, 0, lg);
            step(m, &s, toks, P, 0, lg);
            if (verify) { /* a verify of KMAX drafts, `keep` rows kept: n_replay = keep */
                cr_assert_eq(duet_model_seq_grow(m, &s, P + KMAX + 1), DUET_OK, "%s",
                             duet_error_last());
                step(m, &a, drafts, KMAX + 1, 1, lg);
                step(m, &s, drafts, KMAX + 1, 1, lg);
                cr_assert_eq(duet_model_seq_accept(m, &a, keep), DUET_OK);
                cr_assert_eq(duet_model_seq_accept(m, &s, keep), DUET_OK);
                with_replay += s.n_replay > 0;
            }
            const int64_t held = s.n_tokens;
            const size_t bytes = duet_model_seq_snapshot_bytes(m, held);
            uint8_t *snap = malloc(bytes > 0 ? bytes : 1);
            cr_assert_eq(duet_model_seq_snapshot_save(m, &s, snap), DUET_OK, "%s",
                         duet_error_last());
            cr_assert_eq(s.n_replay, 0, "%s: the snapshot folded the accepted rows in", cs[c].name);
            duet_model_seq_close(m, &s);
            /* another sequence takes the freed pages, so the resumed one gets other pages */
            cr_assert_eq(duet_model_seq_open(m, P, &hole), DUET_OK);
            cr_assert_eq(duet_model_seq_open(m, held + 1, &r), DUET_OK, "%s", duet_error_last());
            cr_assert_eq(duet_model_seq_snapshot_restore(m, &r, snap, held), DUET_OK, "%s",
                         duet_error_last());
            free(snap);
            cr_assert(r.n_tokens == held && r.n_pending == 0 && r.n_replay == 0);
            cr_assert(kv_equal(m, &r, &a, held), "%s trial %d: restored KV differs", cs[c].name,
                      trial);
            /* the continuation one token per step, the suspended one growing as it goes */
            for (int64_t j = 0; j < CONT; j++) {
                cr_assert_eq(duet_model_seq_grow(m, &r, r.n_tokens + 1), DUET_OK, "%s",
                             duet_error_last());
                step(m, &a, &cont[j], 1, 0, la + j * V);
                step(m, &r, &cont[j], 1, 0, lb + j * V);
            }
            cr_assert(memcmp(la, lb, sizeof(float) * (size_t)(CONT * V)) == 0,
                      "%s trial %d (%s): logits after the resume differ from never suspending",
                      cs[c].name, trial, verify ? "unreplayed rows" : "plain");
            cr_assert(kda_equal(m, &r, &a) && kv_equal(m, &r, &a, a.n_tokens),
                      "%s trial %d: caches after the resume differ", cs[c].name, trial);
            duet_model_seq_close(m, &a);
            duet_model_seq_close(m, &r);
            duet_model_seq_close(m, &hole);
        }
        if (kv != NULL)
            cr_assert_eq(duet_kv_pool_n_free(kv), free0, "%s: every page back", cs[c].name);
        printf("spec %-30s suspend (snapshot, close) and resume (open, restore, grow): logits and "
               "caches bit-identical to never suspending\n",
               cs[c].name);
        free(lg);
        free(la);
        free(lb);
        duet_model_free(m);
    }
    cr_assert_geq(with_replay, 2, "expected snapshots taken with unreplayed rows (KDA models)");
    free_cases(cs, n);
}

/* ---- a running request moved to another model instance -------------------------------------- */

/* A test pool allocator (what a generation worker's UCX allocator stands for): zeroed, aligned
 * memory, and which pools asked for it. The model never frees it; the test does. */
typedef struct {
    void *mem[3];
    size_t bytes[3];
} test_pools_t;

static void *test_pool_alloc(void *user, duet_model_pool_t which, size_t bytes)
{
    test_pools_t *tp = user;
    cr_assert((int)which >= 0 && (int)which < 3 && tp->mem[which] == NULL, "pool %d twice",
              (int)which);
    void *p = aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    cr_assert_not_null(p);
    memset(p, 0, bytes);
    tp->mem[which] = p;
    tp->bytes[which] = bytes;
    return p;
}

/* What a transfer moves of sequence `a` of model A into the open, empty sequence `b` of model B
 * (same weights and pool shapes): the KV pages holding its tokens, every KDA layer's block of its
 * slot, and rows [0, a->n_replay) of each KDA layer of its slot in the replay pool, each copied
 * through the pools' layouts (common/cache_layout.h), as the plan's puts copy them. */
static void move_caches(duet_model_t *A, const duet_seq_t *a, duet_model_t *B, const duet_seq_t *b)
{
    duet_kv_pool_t *ka = duet_model_kv_pool(A), *kb = duet_model_kv_pool(B);
    if (ka != NULL) {
        const int64_t PT = duet_kv_pool_desc(ka)->page_tokens;
        for (int64_t pg = 0; pg < (a->n_tokens + PT - 1) / PT; pg++)
            for (int64_t l = 0; l < duet_kv_pool_desc(ka)->n_layers; l++)
                memcpy(duet_kv_pool_block(kb, b->pages[pg], l),
                       duet_kv_pool_block(ka, a->pages[pg], l), duet_kv_pool_block_bytes(ka));
    }
    if (duet_model_kda_pool(A) != NULL)
        memcpy((void *)kda_slot(B, b), kda_slot(A, a), kda_slot_bytes(A));
    if (a->n_replay > 0) {
        duet_replay_pool_t *ra = duet_model_replay_pool(A), *rb = duet_model_replay_pool(B);
        const duet_replay_layout_t la = duet_replay_pool_layout(ra);
        uint64_t row = 0;
        cr_assert(duet_replay_layout_row_bytes(&la, &row));
        for (int64_t l = 0; l < (int64_t)la.n_layers; l++)
            memcpy(duet_replay_pool_row(rb, b->kda_slot, l, 0),
                   duet_replay_pool_row(ra, a->kda_slot, l, 0), (size_t)(row * a->n_replay));
    }
}

/* The replay rows of b's slot from row `from` on, filled with NaN: rows a move did not send must
 * not be read (a NaN would reach the logits). */
static void poison_replay_rows(duet_model_t *B, const duet_seq_t *b, int64_t from)
{
    duet_replay_pool_t *rb = duet_model_replay_pool(B);
    const duet_replay_layout_t l = duet_replay_pool_layout(rb);
    uint64_t row = 0;
    cr_assert(duet_replay_layout_row_bytes(&l, &row));
    for (int64_t layer = 0; layer < (int64_t)l.n_layers; layer++)
        for (int64_t r = from; r < (int64_t)l.rows; r++) {
            float *p = duet_replay_pool_row(rb, b->kda_slot, layer, r);
            for (uint64_t i = 0; i < row / sizeof(float); i++)
                p[i] = NAN;
        }
}

/* Two sequences of two models: the KV rows of positions [0, n) and the KDA slots, byte for byte. */
static int caches_equal(duet_model_t *A, const duet_seq_t *a, duet_model_t *B, const duet_seq_t *b,
                        int64_t n)
{
    if (duet_model_kda_pool(A) != NULL &&
        memcmp(kda_slot(A, a), kda_slot(B, b), kda_slot_bytes(A)) != 0)
        return 0;
    duet_kv_pool_t *p = duet_model_kv_pool(A);
    if (p == NULL)
        return 1;
    const size_t tb = duet_kv_pool_block_bytes(p) / (size_t)duet_kv_pool_desc(p)->page_tokens;
    for (int64_t l = 0; l < duet_kv_pool_desc(p)->n_layers; l++)
        for (int64_t pos = 0; pos < n; pos++)
            if (memcmp(kv_row(A, a, l, pos), kv_row(B, b, l, pos), tb) != 0)
                return 0;
    return 1;
}

/*
 * A generation worker moving a running request to another (issue 37): sequence a of model A,
 * right after a verify and an accept (its last n_replay accepted rows still in the replay pool),
 * is copied into a fresh sequence b of a second instance B of the same checkpoint, whose pools
 * came from its pool_alloc (the replay pool too), as a transfer copies them (move_caches), and
 * handed over with duet_model_seq_set_received. Then both take the same steps: a verify with an
 * accept, plain decode, and (odd trials) the replay-only commit right after the move. Reference:
 * model A, which never moved. Bound: 0 (memcmp) on every logits row, on the KDA slots after the
 * commit and at the end, and on the KV rows. Also the n_replay = 0 path (a plain prefix) and the
 * fullest accept (k + 1 rows). b is placed in other pages and another slot than a (B has a
 * sequence open first), and B's replay rows past n_replay are NaN: only the sent rows are read.
 */
Test(engine_spec, set_received_continues_as_the_sender, .timeout = 900)
{
    spec_case_t cs[MAX_CASES];
    const int n = load_cases(cs);
    int n_moved_with_rows = 0, n_models = 0;
    for (int c = 0; c < n; c++) {
        duet_model_t *A = load_spec(cs[c].dir, SPEC_ROWS);
        test_pools_t tp;
        memset(&tp, 0, sizeof(tp));
        duet_model_opts_t opts = *duet_model_opts(A);
        opts.pool_alloc = test_pool_alloc;
        opts.pool_alloc_user = &tp;
        duet_model_t *B = NULL;
        cr_assert_eq(duet_model_load(cs[c].dir, &opts, &B), DUET_OK, "%s", duet_error_last());
        const int kda = duet_model_kda_pool(B) != NULL;
        if (kda) { /* every pool the model has came from pool_alloc */
            cr_assert_not_null(duet_model_replay_pool(B));
            cr_assert(duet_replay_pool_base(duet_model_replay_pool(B)) ==
                              tp.mem[DUET_MODEL_POOL_REPLAY] &&
                          duet_replay_pool_bytes(duet_model_replay_pool(B)) ==
                              tp.bytes[DUET_MODEL_POOL_REPLAY],
                      "%s: the replay pool is not pool_alloc's memory", cs[c].name);
            cr_assert(duet_kda_pool_base(duet_model_kda_pool(B)) == tp.mem[DUET_MODEL_POOL_KDA]);
        } else {
            cr_assert_null(tp.mem[DUET_MODEL_POOL_REPLAY], "no KDA layers: no replay pool");
        }
        n_models++;
        const int64_t V = duet_model_config(A)->vocab_size, P = 19, CONT = 4;
        float *lg = malloc(sizeof(float) * (size_t)(P * V));
        float *la = malloc(sizeof(float) * (size_t)(SPEC_ROWS * V));
        float *lb = malloc(sizeof(float) * (size_t)(SPEC_ROWS * V));
        for (int trial = 0; trial < 4; trial++) {
            int32_t toks[P], drafts[SPEC_ROWS], drafts2[SPEC_ROWS], cont[CONT];
            for (int64_t i = 0; i < P; i++)
                toks[i] = (int32_t)(rng_u32() % (uint32_t)V);
            for (int j = 0; j < SPEC_ROWS; j++) {
                drafts[j] = (int32_t)(rng_u32() % (uint32_t)V);
                drafts2[j] = (int32_t)(rng_u32() % (uint32_t)V);
            }
            for (int j = 0; j < CONT; j++)
                cont[j] = (int32_t)(rng_u32() % (uint32_t)V);
            const int verify = trial != 2; /* trial 2: a plain prefix, nothing to replay */
            const int64_t keep = trial == 3 ? SPEC_ROWS : 1 + rng_u32() % SPEC_ROWS;
            duet_seq_t a, b, other;
            cr_assert_eq(duet_model_seq_open(A, P + 32, &a), DUET_OK);
            cr_assert_eq(duet_model_seq_open(B, P + 16, &other), DUET_OK);
            cr_assert_eq(duet_model_seq_open(B, P + 32, &b), DUET_OK);
            step(A, &a, toks, P, 0, lg);
            if (verify) {
                step(A, &a, drafts, SPEC_ROWS, 1, la);
                cr_assert_eq(duet_model_seq_accept(A, &a, keep), DUET_OK);
            }
            const int64_t n_replay = a.n_replay;
            cr_assert_eq(n_replay, verify && kda ? keep : 0);
            n_moved_with_rows += n_replay > 0;
            move_caches(A, &a, B, &b);
            if (kda)
                poison_replay_rows(B, &b, n_replay);
            cr_assert_eq(duet_model_seq_set_received(B, &b, a.n_tokens, n_replay), DUET_OK, "%s",
                         duet_error_last());
            cr_assert(b.n_tokens == a.n_tokens && b.n_replay == n_replay && b.n_pending == 0,
                      "%s: b holds %lld tokens, %lld to replay", cs[c].name, (long long)b.n_tokens,
                      (long long)b.n_replay);
            if (trial % 2 == 1) { /* the replay-only commit on both: the same state */
                cr_assert_eq(duet_model_seq_commit(A, &a), DUET_OK, "%s", duet_error_last());
                cr_assert_eq(duet_model_seq_commit(B, &b), DUET_OK, "%s", duet_error_last());
                cr_assert(b.n_replay == 0 && caches_equal(A, &a, B, &b, a.n_tokens),
                          "%s trial %d: the commit after the move differs", cs[c].name, trial);
            }
            /* a verify (folding the moved rows in first) and an accept, on both */
            step(A, &a, drafts2, SPEC_ROWS, 1, la);
            step(B, &b, drafts2, SPEC_ROWS, 1, lb);
            cr_assert(memcmp(la, lb, sizeof(float) * (size_t)(SPEC_ROWS * V)) == 0,
                      "%s trial %d (%lld rows moved): verify logits after the move differ",
                      cs[c].name, trial, (long long)n_replay);
            const int64_t keep2 = 1 + rng_u32() % SPEC_ROWS;
            cr_assert_eq(duet_model_seq_accept(A, &a, keep2), DUET_OK);
            cr_assert_eq(duet_model_seq_accept(B, &b, keep2), DUET_OK);
            for (int64_t j = 0; j < CONT; j++) { /* then plain decode */
                step(A, &a, &cont[j], 1, 0, la);
                step(B, &b, &cont[j], 1, 0, lb);
                cr_assert(memcmp(la, lb, sizeof(float) * (size_t)V) == 0,
                          "%s trial %d (%lld rows moved): step %lld after the move differs",
                          cs[c].name, trial, (long long)n_replay, (long long)j);
            }
            cr_assert(a.n_tokens == b.n_tokens && caches_equal(A, &a, B, &b, a.n_tokens),
                      "%s trial %d: caches after the move differ", cs[c].name, trial);
            duet_model_seq_close(A, &a);
            duet_model_seq_close(B, &b);
            duet_model_seq_close(B, &other);
        }
        printf("spec %-30s moved to a second instance (set_received, replay rows sent): logits "
               "and caches bit-identical to the sender's\n",
               cs[c].name);
        free(lg);
        free(la);
        free(lb);
        duet_model_free(A);
        duet_model_free(B);
        for (int i = 0; i < 3; i++)
            free(tp.mem[i]);
    }
    cr_assert_geq(n_moved_with_rows, 6, "expected moves with unreplayed rows (KDA models)");
    free_cases(cs, n);
}

/* ---- refusals -------------------------------------------------------------------------------- */

static void expect_err(duet_status_t got, duet_status_t want, const char *needle, const char *what)
{
    cr_expect_eq(got, want, "%s: status %d, expected %d (%s)", what, (int)got, (int)want,
                 duet_error_last());
    cr_expect_not_null(strstr(duet_error_last(), needle), "%s: '%s' does not say '%s'", what,
                       duet_error_last(), needle);
}

Test(engine_spec, bad_verify_items_and_calls_are_refused, .timeout = 120)
{
    spec_case_t cs[MAX_CASES];
    const int n = load_cases(cs);
    const spec_case_t *x = &cs[0]; /* a fixture with KDA layers */
    duet_model_t *m = load_spec(x->dir, SPEC_ROWS);
    cr_assert_not_null(duet_model_kda_pool(m));
    const int64_t V = duet_model_config(m)->vocab_size;
    float *lg = malloc(sizeof(float) * (size_t)(64 * V));
    int32_t toks[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
    duet_seq_t s, o;
    cr_assert_eq(duet_model_seq_open(m, 64, &s), DUET_OK);
    cr_assert(s.n_pending == 0 && s.n_replay == 0, "a fresh sequence has nothing pending");
    cr_assert_eq(duet_model_seq_open(m, 64, &o), DUET_OK);
    step(m, &s, toks, 4, 0, lg);
    step(m, &o, toks, 4, 0, lg);

    duet_batch_item_t it = {
        .seq = &s, .tokens = toks, .n_tokens = 3, .logits_mode = DUET_LOGITS_LAST, .logits = lg};
    it.verify = 1;
    expect_err(duet_model_forward(m, &it, 1), DUET_ERR_INVALID, "DUET_LOGITS_ALL",
               "verify with LOGITS_LAST");
    it.logits_mode = DUET_LOGITS_TOKEN;
    expect_err(duet_model_forward(m, &it, 1), DUET_ERR_INVALID, "DUET_LOGITS_ALL",
               "verify with LOGITS_TOKEN");
    it.logits_mode = DUET_LOGITS_ALL;
    it.n_tokens = SPEC_ROWS + 1;
    expect_err(duet_model_forward(m, &it, 1), DUET_ERR_RANGE, "spec_rows", "verify over spec_rows");
    it.n_tokens = 1;
    expect_err(duet_model_forward(m, &it, 1), DUET_ERR_RANGE, "2..spec_rows", "verify of one row");
    it.n_tokens = 3;
    it.verify = 2;
    expect_err(duet_model_forward(m, &it, 1), DUET_ERR_INVALID, "not 0 or 1", "verify = 2");
    cr_expect(s.n_tokens == 4 && s.n_pending == 0, "refused items change nothing");

    expect_err(duet_model_seq_accept(m, &s, 1), DUET_ERR_INVALID, "no verify rows pending",
               "accept without a verify");
    it.verify = 1;
    cr_assert_eq(duet_model_forward(m, &it, 1), DUET_OK, "%s", duet_error_last());
    cr_assert(s.n_pending == 3 && s.n_tokens == 4);
    /* a sequence with pending rows is not forwarded, alone or in a batch */
    duet_batch_item_t two[2] = {
        {.seq = &o, .tokens = toks, .n_tokens = 1, .logits_mode = DUET_LOGITS_ALL, .logits = lg},
        {.seq = &s, .tokens = toks, .n_tokens = 1, .logits_mode = DUET_LOGITS_ALL, .logits = lg},
    };
    expect_err(duet_model_forward(m, two, 2), DUET_ERR_INVALID, "pending",
               "forward with pending rows");
    cr_expect_eq(o.n_tokens, 4, "the batch's other sequence is not advanced");
    expect_err(duet_model_forward(m, &it, 1), DUET_ERR_INVALID, "pending",
               "verify with pending rows");
    expect_err(duet_model_seq_commit(m, &s), DUET_ERR_INVALID, "accept them first",
               "commit with pending rows");
    expect_err(duet_model_seq_accept(m, &s, 0), DUET_ERR_RANGE, "1..3", "accept 0");
    expect_err(duet_model_seq_accept(m, &s, 4), DUET_ERR_RANGE, "1..3", "accept > n_pending");
    expect_err(duet_model_seq_accept(m, &s, -1), DUET_ERR_RANGE, "1..3", "accept -1");
    cr_expect(s.n_tokens == 4 && s.n_pending == 3, "refused accepts change nothing");
    cr_assert_eq(duet_model_seq_accept(m, &s, 2), DUET_OK);
    expect_err(duet_model_seq_accept(m, &s, 1), DUET_ERR_INVALID, "no verify rows pending",
               "a second accept");
    expect_err(duet_model_seq_truncate(m, &s, 2, NULL), DUET_ERR_INVALID, "KDA",
               "truncate with KDA layers and no saved state");
    cr_expect(s.n_tokens == 6 && s.n_replay == 2);
    uint8_t *saved = malloc(duet_model_seq_state_bytes(m));
    expect_err(duet_model_seq_state_save(m, &s, saved), DUET_ERR_INVALID, "commit them first",
               "state save with rows to replay");
    cr_assert_eq(duet_model_seq_commit(m, &s), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_model_seq_state_save(m, &s, saved), DUET_OK, "%s", duet_error_last());
    expect_err(duet_model_seq_truncate(m, &s, 7, saved), DUET_ERR_RANGE, "0..6",
               "truncate forward with KDA layers");
    cr_expect(s.n_tokens == 6, "a refused truncate changes nothing");
    /* set_filled refuses a sequence holding tokens; a closed sequence is refused everywhere */
    expect_err(duet_model_seq_set_filled(m, &s, 1), DUET_ERR_RANGE, "holding",
               "set_filled on a used sequence");
    duet_model_seq_close(m, &s);
    cr_expect(s.n_pending == 0 && s.n_replay == 0);
    expect_err(duet_model_seq_accept(m, &s, 1), DUET_ERR_INVALID, "not an open", "closed accept");
    expect_err(duet_model_seq_commit(m, &s), DUET_ERR_INVALID, "not an open", "closed commit");
    expect_err(duet_model_seq_truncate(m, &s, 0, saved), DUET_ERR_INVALID, "not an open",
               "closed truncate");
    expect_err(duet_model_seq_state_save(m, &s, saved), DUET_ERR_INVALID, "not an open",
               "closed state save");
    expect_err(duet_model_seq_state_restore(m, &s, saved), DUET_ERR_INVALID, "not an open",
               "closed state restore");
    free(saved);
    duet_model_seq_close(m, &o);
    duet_model_free(m);

    /* a model without spec_rows refuses verify items */
    m = load_spec(x->dir, 0);
    cr_assert_null(duet_model_replay_pool(m));
    cr_assert_eq(duet_model_seq_open(m, 64, &s), DUET_OK);
    it.seq = &s;
    expect_err(duet_model_forward(m, &it, 1), DUET_ERR_INVALID, "without spec_rows",
               "verify without spec_rows");
    duet_model_seq_close(m, &s);
    duet_model_free(m);

    /* truncate's range, on an MLA-only model */
    char dir[64];
    make_mla_only(dir, sizeof(dir));
    m = load_spec(dir, 0);
    cr_assert_eq(duet_model_seq_open(m, 64, &s), DUET_OK);
    step(m, &s, toks, 5, 0, lg);
    expect_err(duet_model_seq_truncate(m, &s, 6, NULL), DUET_ERR_RANGE, "0..5", "truncate forward");
    expect_err(duet_model_seq_truncate(m, &s, -1, NULL), DUET_ERR_RANGE, "0..5", "truncate to -1");
    cr_expect_eq(s.n_tokens, 5);
    cr_expect_eq(duet_model_seq_state_bytes(m), 0, "no KDA layers: no state to copy");
    cr_assert_eq(duet_model_seq_truncate(m, &s, 0, NULL), DUET_OK);
    duet_model_seq_close(m, &s);
    duet_model_free(m);
    mla_only_remove(dir);
    free(lg);
    free_cases(cs, n);
}

/* DUET_LOGITS_ARGMAX: a verify item's (and a plain row's) arg-maxes are duet_argmax of the rows
 * DUET_LOGITS_ALL returns for the same item, and everything else the step leaves is the same:
 * two sequences with the same caches, one verified each way in one batch. */
Test(engine_spec, argmax_rows_equal_argmax_of_all_rows, .timeout = 300)
{
    spec_case_t cs[MAX_CASES];
    const int n = load_cases(cs);
    for (int c = 0; c < n; c++) {
        duet_model_t *m = load_spec(cs[c].dir, SPEC_ROWS);
        const int64_t V = duet_model_config(m)->vocab_size, np = cs[c].n_prompt;
        const int64_t cap = np + 4 * SPEC_ROWS;
        float *lg = malloc(sizeof(float) * (size_t)(SPEC_ROWS * V));
        cr_assert_not_null(lg);
        duet_seq_t a, b;
        cr_assert_eq(duet_model_seq_open(m, cap, &a), DUET_OK);
        duet_batch_item_t pre = {.seq = &a,
                                 .tokens = cs[c].prompt,
                                 .n_tokens = np,
                                 .logits_mode = DUET_LOGITS_LAST,
                                 .logits = lg};
        cr_assert_eq(duet_model_forward(m, &pre, 1), DUET_OK, "%s", duet_error_last());
        clone_seq(m, &a, cap, &b);
        int32_t rows[SPEC_ROWS], got[SPEC_ROWS + 1];
        for (int round = 0; round < 3; round++) {
            /* round 0, 1: verify items of SPEC_ROWS and 2 rows; round 2: a plain row (after the
             * accepted rows' replay is folded in) */
            const int64_t nr = round == 0 ? SPEC_ROWS : round == 1 ? 2 : 1;
            for (int64_t j = 0; j < nr; j++)
                rows[j] = (int32_t)((7 * round + 13 * j + 1) % V);
            memset(got, 0xff, sizeof(got));
            duet_batch_item_t it[2] = {{.seq = &a,
                                        .tokens = rows,
                                        .n_tokens = nr,
                                        .verify = nr > 1,
                                        .logits_mode = nr > 1 ? DUET_LOGITS_ALL : DUET_LOGITS_LAST,
                                        .logits = lg},
                                       {.seq = &b,
                                        .tokens = rows,
                                        .n_tokens = nr,
                                        .verify = nr > 1,
                                        .logits_mode = DUET_LOGITS_ARGMAX,
                                        .token_out = got}};
            cr_assert_eq(duet_model_forward(m, it, 2), DUET_OK, "%s", duet_error_last());
            for (int64_t j = 0; j < nr; j++)
                cr_expect_eq(got[j], duet_argmax(lg + j * V, V), "%s round %d row %lld: %d vs %d",
                             cs[c].name, round, (long long)j, got[j], duet_argmax(lg + j * V, V));
            cr_expect_eq(got[nr], -1, "%s: ARGMAX wrote past its rows", cs[c].name);
            if (nr > 1) {
                cr_assert(a.n_pending == nr && b.n_pending == nr);
                cr_assert_eq(duet_model_seq_accept(m, &a, nr - 1), DUET_OK);
                cr_assert_eq(duet_model_seq_accept(m, &b, nr - 1), DUET_OK);
            }
            cr_expect(a.n_tokens == b.n_tokens && kda_equal(m, &a, &b),
                      "%s round %d: the two sequences' caches differ", cs[c].name, round);
        }
        /* nowhere to put them */
        duet_batch_item_t bad = {
            .seq = &a, .tokens = rows, .n_tokens = 1, .logits_mode = DUET_LOGITS_ARGMAX};
        expect_err(duet_model_forward(m, &bad, 1), DUET_ERR_INVALID, "nowhere to put",
                   "ARGMAX without token_out");
        duet_model_seq_close(m, &a);
        duet_model_seq_close(m, &b);
        duet_model_free(m);
        free(lg);
    }
    free_cases(cs, n);
}

/* duet_model_seq_sync_host on the CPU backend, whose pools are the host's: nothing to copy, the
 * accepted rows stay in the (host) replay pool to travel with a move, the caches unchanged; and
 * its refusals: pending verify rows, a closed sequence. */
Test(engine_spec, sync_host_on_the_cpu_changes_nothing, .timeout = 120)
{
    spec_case_t cs[MAX_CASES];
    const int n = load_cases(cs);
    duet_model_t *m = load_spec(cs[0].dir, SPEC_ROWS);
    const int64_t V = duet_model_config(m)->vocab_size, np = cs[0].n_prompt;
    float *lg = malloc(sizeof(float) * (size_t)(SPEC_ROWS * V));
    duet_seq_t a;
    cr_assert_eq(duet_model_seq_open(m, np + 2 * SPEC_ROWS, &a), DUET_OK);
    duet_batch_item_t pre = {.seq = &a,
                             .tokens = cs[0].prompt,
                             .n_tokens = np,
                             .logits_mode = DUET_LOGITS_LAST,
                             .logits = lg};
    cr_assert_eq(duet_model_forward(m, &pre, 1), DUET_OK, "%s", duet_error_last());
    const int32_t rows[3] = {1, 2, 3};
    duet_batch_item_t ver = {.seq = &a,
                             .tokens = rows,
                             .n_tokens = 3,
                             .verify = 1,
                             .logits_mode = DUET_LOGITS_ALL,
                             .logits = lg};
    cr_assert_eq(duet_model_forward(m, &ver, 1), DUET_OK, "%s", duet_error_last());
    expect_err(duet_model_seq_sync_host(m, &a), DUET_ERR_INVALID, "pending",
               "sync with pending rows");
    cr_assert_eq(duet_model_seq_accept(m, &a, 2), DUET_OK);
    const int64_t replay = a.n_replay, tokens = a.n_tokens;
    uint8_t *before = duet_model_kda_pool(m) != NULL ? malloc(kda_slot_bytes(m)) : NULL;
    if (before != NULL)
        memcpy(before, kda_slot(m, &a), kda_slot_bytes(m));
    cr_assert_eq(duet_model_seq_sync_host(m, &a), DUET_OK, "%s", duet_error_last());
    cr_expect(a.n_replay == replay && a.n_tokens == tokens,
              "sync_host changed the sequence (%lld replay rows, %lld tokens)",
              (long long)a.n_replay, (long long)a.n_tokens);
    cr_expect(before == NULL || memcmp(before, kda_slot(m, &a), kda_slot_bytes(m)) == 0,
              "sync_host changed a host-resident state");
    duet_model_seq_close(m, &a);
    expect_err(duet_model_seq_sync_host(m, &a), DUET_ERR_INVALID, "not an open sequence",
               "sync a closed sequence");
    free(before);
    free(lg);
    duet_model_free(m);
    free_cases(cs, n);
}

Test(engine_spec, bad_spec_rows_are_refused_at_load, .timeout = 120)
{
    spec_case_t cs[MAX_CASES];
    const int n = load_cases(cs);
    duet_model_opts_t opts;
    duet_model_t *m = NULL;
    struct {
        int64_t spec_rows, batch, seq_len;
        duet_device_kind_t dev;
        duet_status_t want;
        const char *needle;
    } cases[] = {
        {1, 512, 640, DUET_DEVICE_CPU, DUET_ERR_INVALID, "at least 2"},
        {-3, 512, 640, DUET_DEVICE_CPU, DUET_ERR_INVALID, "at least 2"},
        {65, 64, 640, DUET_DEVICE_CPU, DUET_ERR_RANGE, "max_batch_tokens 64"},
        {65, 512, 64, DUET_DEVICE_CPU, DUET_ERR_RANGE, "max_seq_len 64"},
        /* the replay pool's size overflows before anything is allocated for it */
        {(int64_t)1 << 60, (int64_t)1 << 61, (int64_t)1 << 61, DUET_DEVICE_CPU, DUET_ERR_INVALID,
         "replay pool"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        duet_model_opts_default(&opts);
        opts.n_threads = 1;
        opts.max_seqs = 2;
        opts.page_tokens = 16;
        opts.kv_pages = 8;
        opts.spec_rows = cases[i].spec_rows;
        opts.max_batch_tokens = cases[i].batch;
        opts.max_seq_len = cases[i].seq_len;
        opts.device = cases[i].dev;
        char what[64];
        snprintf(what, sizeof(what), "load case %zu", i);
        expect_err(duet_model_load(cs[0].dir, &opts, &m), cases[i].want, cases[i].needle, what);
        cr_expect_null(m);
    }
    free_cases(cs, n);
}

/* Growing and snapshots refuse what they cannot do, changing nothing. */
Test(engine_spec, grow_and_snapshot_refusals, .timeout = 120)
{
    spec_case_t cs[MAX_CASES];
    const int n = load_cases(cs);
    duet_model_opts_t opts; /* the demo model (KDA and MLA) with a pool of 4 pages */
    duet_model_opts_default(&opts);
    opts.n_threads = 2;
    opts.max_seqs = 4;
    opts.max_seq_len = 640;
    opts.page_tokens = 16;
    opts.kv_pages = 4;
    opts.spec_rows = SPEC_ROWS;
    duet_model_t *m = NULL;
    cr_assert_eq(duet_model_load(cs[n - 1].dir, &opts, &m), DUET_OK, "%s", duet_error_last());
    duet_kv_pool_t *kv = duet_model_kv_pool(m);
    cr_assert_not_null(kv);
    const int64_t V = duet_model_config(m)->vocab_size;
    float *lg = malloc(sizeof(float) * (size_t)(SPEC_ROWS * V));
    int32_t toks[SPEC_ROWS] = {1, 2, 3, 4, 5};
    duet_seq_t s, t, closed = {.id = -1};
    cr_assert_eq(duet_model_seq_open(m, 16, &s), DUET_OK);
    expect_err(duet_model_seq_grow(m, &s, 641), DUET_ERR_RANGE, "at most 640", "grow past max");
    expect_err(duet_model_seq_grow(m, &closed, 32), DUET_ERR_INVALID, "not an open", "grow closed");
    /* take every free page but one, then ask for two more */
    const int64_t left = duet_kv_pool_n_free(kv);
    cr_assert_eq(duet_model_seq_open(m, (left - 1) * 16, &t), DUET_OK, "%s", duet_error_last());
    expect_err(duet_model_seq_grow(m, &s, 48), DUET_ERR_NO_SPACE, "pages wanted", "grow, no room");
    cr_assert(s.n_pages == 1 && s.cap_tokens == 16 && duet_kv_pool_n_free(kv) == 1,
              "a refused grow changes nothing");
    cr_assert_eq(duet_model_seq_grow(m, &s, 32), DUET_OK, "%s", duet_error_last());
    cr_assert(s.n_pages == 2 && s.cap_tokens == 32 && duet_kv_pool_n_free(kv) == 0);
    /* a snapshot of a sequence with verify rows pending is refused */
    step(m, &s, toks, SPEC_ROWS, 1, lg);
    uint8_t *snap = malloc(duet_model_seq_snapshot_bytes(m, 32));
    expect_err(duet_model_seq_snapshot_save(m, &s, snap), DUET_ERR_INVALID, "accept them",
               "snapshot with pending rows");
    expect_err(duet_model_seq_snapshot_save(m, &closed, snap), DUET_ERR_INVALID, "not an open",
               "snapshot of a closed sequence");
    cr_assert_eq(duet_model_seq_accept(m, &s, 2), DUET_OK);
    cr_assert_eq(duet_model_seq_snapshot_save(m, &s, snap), DUET_OK, "%s", duet_error_last());
    /* restoring into a sequence that holds tokens, or past its capacity, is refused */
    expect_err(duet_model_seq_snapshot_restore(m, &s, snap, 2), DUET_ERR_RANGE, "holding 2",
               "restore into a non-empty sequence");
    duet_model_seq_close(m, &t);
    cr_assert_eq(duet_model_seq_open(m, 16, &t), DUET_OK);
    expect_err(duet_model_seq_snapshot_restore(m, &t, snap, 17), DUET_ERR_RANGE, "capacity 16",
               "restore past the capacity");
    cr_assert_eq(t.n_tokens, 0);
    free(snap);
    free(lg);
    duet_model_seq_close(m, &s);
    duet_model_seq_close(m, &t);
    duet_model_free(m);
    free_cases(cs, n);
}

Test(engine_spec, set_received_refusals, .timeout = 120)
{
    spec_case_t cs[MAX_CASES];
    const int n = load_cases(cs);
    duet_model_t *m = load_spec(cs[n - 1].dir, SPEC_ROWS); /* the demo model: KDA and MLA */
    cr_assert_not_null(duet_model_replay_pool(m));
    duet_seq_t s, closed = {.id = -1};
    cr_assert_eq(duet_model_seq_open(m, 32, &s), DUET_OK);
    expect_err(duet_model_seq_set_received(m, &closed, 8, 2), DUET_ERR_INVALID, "not an open",
               "set_received on a closed sequence");
    expect_err(duet_model_seq_set_received(m, &s, 8, -1), DUET_ERR_RANGE, "negative",
               "n_replay -1");
    expect_err(duet_model_seq_set_received(m, &s, 3, 4), DUET_ERR_RANGE, "4 replay rows of 3",
               "n_replay > n_tokens");
    expect_err(duet_model_seq_set_received(m, &s, 16, SPEC_ROWS + 1), DUET_ERR_RANGE, "spec_rows 5",
               "n_replay > spec_rows");
    expect_err(duet_model_seq_set_received(m, &s, 33, 2), DUET_ERR_RANGE, "capacity 32",
               "n_tokens past the capacity");
    cr_assert(s.n_tokens == 0 && s.n_replay == 0, "refusals change nothing");
    cr_assert_eq(duet_model_seq_set_received(m, &s, 8, 2), DUET_OK, "%s", duet_error_last());
    cr_assert(s.n_tokens == 8 && s.n_replay == 2 && s.n_pending == 0);
    expect_err(duet_model_seq_set_received(m, &s, 8, 2), DUET_ERR_RANGE, "holding 8",
               "set_received into a sequence holding tokens");
    duet_model_seq_close(m, &s);
    duet_model_free(m);

    /* no replay pool: without spec_rows, and on a model without KDA layers */
    m = load_spec(cs[n - 1].dir, 0);
    cr_assert_eq(duet_model_seq_open(m, 32, &s), DUET_OK);
    expect_err(duet_model_seq_set_received(m, &s, 8, 1), DUET_ERR_INVALID, "spec_rows 0",
               "set_received without a replay pool");
    cr_assert_eq(duet_model_seq_set_received(m, &s, 8, 0), DUET_OK, "%s", duet_error_last());
    cr_assert(s.n_tokens == 8 && s.n_replay == 0, "n_replay 0 is set_filled");
    duet_model_seq_close(m, &s);
    duet_model_free(m);
    char dir[64];
    make_mla_only(dir, sizeof(dir));
    m = load_spec(dir, SPEC_ROWS);
    cr_assert_eq(duet_model_seq_open(m, 32, &s), DUET_OK);
    expect_err(duet_model_seq_set_received(m, &s, 8, 1), DUET_ERR_INVALID, "KDA layers",
               "set_received on an MLA-only model");
    duet_model_seq_close(m, &s);
    duet_model_free(m);
    mla_only_remove(dir);
    free_cases(cs, n);
}
