/*
 * duet-bench-model-cuda: the CUDA engine at a real model's dimensions with random weights
 * generated on the device (no checkpoint): decode step time per batch and context against the
 * memory roofline, and prefill tokens/s against the cuBLASLt bf16 GEMM rate, all measured in one
 * run on one device.
 *
 *   duet-bench-model-cuda --config DIR [--layers N] [--batch 1,8,64] [--context 2048,32768]
 *                         [--steps 20] [--prefill 2048,8192] [--dtype bf16|f32] [--kv bf16|f32]
 *                         [--tune [--tune_file PATH]] [--verify 1,2,3,4 [--mixed]]
 *                         [--no-graphs]
 *
 * Decode: B sequences are opened with C tokens of context "filled" (device pools hold random
 * KV and state, which costs the same to read as real ones), then `steps` decode steps run with
 * the next token drawn on the device (greedy); the median wall time per step is reported (host
 * included: this is what a serving loop sees). The roofline is the bytes one step must move
 * (every weight it reads once, the experts its rows route to, every KV row of every sequence,
 * the KDA states read and written) divided by the device-to-device copy bandwidth measured in
 * the same run (bytes read + written per second). Experts touched per layer at batch B are the
 * expectation under uniform routing, E·(1 − (1 − k/E)^B).
 * Verify (--verify K_LIST, speculative decoding): the model is loaded with spec_rows = max k + 1
 * (model.h "Speculative decoding"). At each batch and context, right after its decode
 * measurement on the same sequences, each k of the list rolls every sequence back to C tokens
 * (duet_model_seq_truncate) and runs `steps` steps in which every sequence carries one verify
 * item of k + 1 random tokens, the logits of every row copied to the host (pageable memory, as
 * duet-gen's), then keeps one row (duet_model_seq_accept 1, the least a step keeps, so that each
 * step also folds one replay row in, as a serving loop's do). Context grows one token per step, as
 * in decode. The median time per step (forward + accepts) is reported with its ratio to the
 * decode step's, then the same with only each row's arg-max returned (DUET_LOGITS_ARGMAX, what
 * greedy speculation asks for), and the verify step's memory roofline against decode's: the
 * experts B·(k+1) rows route to, the same KV, the state read by the verify and read and written
 * by the replay. With --mixed the steps are mixed instead: sequence s drafts s mod (k + 1)
 * tokens, so a step holds verify items of every length 2..k + 1 beside one-row plain items (the
 * forward commits their row; no accept), as a serving loop whose drafters propose unevenly does.
 * --no-graphs loads the model with cuda_graphs off (every step kernel by kernel): a run with and
 * one without it compare the graphs' gain side by side.
 * Prefill: one sequence of P tokens in one forward call; tokens/s, and the step's GEMM FLOPs
 * (2 · active matrix parameters · P) per second against a cuBLASLt bf16 GEMM of the model's
 * largest projection shape at M = P timed in the same run.
 * --tune loads the model with opts.tune (the GEMM's cuBLASLt algorithm per shape, profiled at load
 * or read from --tune_file: kernels/cuda/cuda_gemm.h "Tactics"); every measurement line says
 * "tuned", so a run with and one without --tune compare side by side.
 * Output: one JSON object per measurement on stdout, progress on stderr. Exits 0 without a
 * device (nothing to measure), 1 on errors.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "common/config.h"
#include "common/log.h"
#include "common/version.h"
#include "engine/model.h"
#include "kernels/cuda/cuda_gemm.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_util.h"

#define MAX_LIST 16

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int parse_list(const char *s, int64_t *out, int cap)
{
    int n = 0;
    while (*s != '\0' && n < cap) {
        char *end;
        long long v = strtoll(s, &end, 10);
        if (end == s || v <= 0)
            return -1;
        out[n++] = v;
        s = *end == ',' ? end + 1 : end;
        if (*end != ',' && *end != '\0')
            return -1;
    }
    return n;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* xorshift64*: the verify items' stand-in tokens */
static uint64_t rng_next(uint64_t *x)
{
    *x ^= *x >> 12;
    *x ^= *x << 25;
    *x ^= *x >> 27;
    return *x * 2685821657736338717ull;
}

/*
 * One verify measurement (see the header): roll the B sequences back to C tokens with KDA state
 * `state`, then 3 warm-up and `steps` timed steps of one verify item of k + 1 random tokens per
 * sequence (mixed: of s mod (k + 1) + 1 tokens, a plain item when that is 1) (logits of every row
 * into `logits`, B * (k + 1) * vocab floats; with `amax` instead only each row's arg-max,
 * DUET_LOGITS_ARGMAX, into amax[B * (k + 1)]), each followed by duet_model_seq_accept(1) for every
 * sequence. The sequences must have room for C + steps + 3 + k tokens. Returns the median seconds
 * per step (forward + accepts), or -1 after printing the error.
 */
static double verify_step_s(duet_model_t *m, duet_seq_t *seqs, int64_t B, int64_t C, int64_t k,
                            int mixed, int64_t steps, const void *state, duet_batch_item_t *items,
                            int32_t *tok, float *logits, int32_t *amax, double *ts, uint64_t *rng)
{
    const int64_t V = duet_model_config(m)->vocab_size, rows = k + 1;
    duet_status_t st = DUET_OK;
    for (int64_t s = 0; s < B && st == DUET_OK; s++)
        st = duet_model_seq_truncate(m, &seqs[s], C, state);
    for (int64_t it = -3; it < steps && st == DUET_OK; it++) {
        for (int64_t s = 0; s < B; s++) {
            const int64_t n = mixed ? s % rows + 1 : rows;
            for (int64_t r = 0; r < n; r++)
                tok[s * rows + r] = (int32_t)(rng_next(rng) % (uint64_t)V);
            items[s] = (duet_batch_item_t){.seq = &seqs[s],
                                           .tokens = &tok[s * rows],
                                           .n_tokens = n,
                                           .logits_mode = amax != NULL ? DUET_LOGITS_ARGMAX
                                                          : n > 1      ? DUET_LOGITS_ALL
                                                                       : DUET_LOGITS_LAST,
                                           .logits = logits + (size_t)(s * rows) * (size_t)V,
                                           .token_out = amax != NULL ? amax + s * rows : NULL,
                                           .verify = n > 1};
        }
        double a = now_s();
        st = duet_model_forward(m, items, B);
        for (int64_t s = 0; s < B && st == DUET_OK; s++)
            if (items[s].verify)
                st = duet_model_seq_accept(m, &seqs[s], 1);
        if (it >= 0)
            ts[it] = now_s() - a;
    }
    if (st != DUET_OK) {
        fprintf(stderr, "verify B=%lld C=%lld k=%lld: %s\n", (long long)B, (long long)C,
                (long long)k, duet_error_last());
        return -1;
    }
    qsort(ts, (size_t)steps, sizeof(double), cmp_d);
    return ts[steps / 2];
}

/* Parameters of every matrix a token's forward reads, split into always-read and per-expert. */
static void count_params(const duet_model_config_t *c, double *dense, double *expert, double *embed)
{
    const double D = (double)c->hidden_size, H = (double)c->kda_heads, K = (double)c->kda_head_dim;
    const double n = (double)c->mla_heads, dn = (double)c->qk_nope_head_dim,
                 dr = (double)c->qk_rope_head_dim, dv = (double)c->v_head_dim,
                 r = (double)c->kv_lora_rank;
    double d = (double)c->vocab_size * D; /* lm_head */
    for (int64_t l = 0; l < c->num_layers; l++) {
        if (c->mixer[l] == DUET_MIXER_KDA)
            d += 3 * H * K * D + 2 * K * D + H * D + 2 * H * K * K + D * H * K;
        else
            d += n * (dn + dr) * D + (r + dr) * D + n * r * dn + n * dv * r + D * n * dv;
        if (c->ffn[l] == DUET_FFN_MOE)
            d += (double)c->n_experts * D +
                 3.0 * D * (double)(c->moe_intermediate * c->n_shared_experts);
        else
            d += 3.0 * D * (double)c->dense_intermediate;
    }
    *dense = d;
    *expert = 3.0 * D * (double)c->moe_intermediate;
    *embed = (double)c->vocab_size * D;
}

int main(int argc, char **argv)
{
    const char *cfg_dir = NULL, *dtype = "bf16", *kvdt = "bf16", *tune_file = NULL;
    int tune = 0, mixed = 0, graphs = 1;
    int64_t layers = 0, steps = 20, batch[MAX_LIST] = {1, 8, 64}, ctx[MAX_LIST] = {2048, 32768},
            pre[MAX_LIST] = {2048, 8192}, vk[MAX_LIST];
    int n_batch = 3, n_ctx = 2, n_pre = 2, n_vk = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (duet_version_flag(a)) {
            duet_version_print("duet-bench-model-cuda");
            return 0;
        }
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            printf("usage: duet-bench-model-cuda --config DIR [--layers N] [--batch 1,8,64]\n"
                   "       [--context 2048,32768] [--steps 20] [--prefill 2048,8192]\n"
                   "       [--dtype bf16|f32] [--kv bf16|f32] [--tune [--tune_file PATH]]\n"
                   "       [--verify K_LIST [--mixed]] [--no-graphs]\n"
                   "Decode step time vs the memory roofline and prefill tok/s vs the cuBLASLt\n"
                   "GEMM rate of a model with DIR/config.json's dimensions and random weights\n"
                   "generated on the GPU. JSON lines on stdout. --prefill 0 skips prefill,\n"
                   "--batch 0 skips decode.\n"
                   "--tune autotunes the model at load (each weight GEMM shape runs the fastest\n"
                   "of cuBLASLt's first 4 algorithms; the load time includes the profiling);\n"
                   "--tune_file PATH (implies --tune) loads that table if it exists, else\n"
                   "profiles and saves it there.\n"
                   "Every line says \"tuned\": run with and without --tune to compare.\n"
                   "--verify 1,2,4 (speculative decoding) loads the model with spec_rows =\n"
                   "max k + 1 and, after each decode measurement, times steps where every\n"
                   "sequence verifies k random drafts (k + 1 rows, all logits to the host)\n"
                   "and keeps one row, at the same batch and context: {\"bench\":\"verify\",\n"
                   "...,\"ms\",\"decode_ms\",\"ratio\"} per k. Needs --batch.\n"
                   "--mixed: sequence s drafts s mod (k + 1) tokens instead (verify items of\n"
                   "every length beside plain one-row items).\n"
                   "--no-graphs: every step kernel by kernel (no CUDA graphs).\n");
            return 0;
        }
        if (strcmp(a, "--tune") == 0) {
            tune = 1;
            continue;
        }
        if (strcmp(a, "--mixed") == 0) {
            mixed = 1;
            continue;
        }
        if (strcmp(a, "--no-graphs") == 0) {
            graphs = 0;
            continue;
        }
        if (v == NULL) {
            fprintf(stderr, "duet-bench-model-cuda: %s needs a value (see --help)\n", a);
            return 2;
        }
        i++;
        int bad = 0;
        if (strcmp(a, "--config") == 0)
            cfg_dir = v;
        else if (strcmp(a, "--tune_file") == 0)
            tune_file = v;
        else if (strcmp(a, "--layers") == 0)
            bad = duet_config_parse_int(v, 1, INT64_MAX, &layers) != DUET_OK;
        else if (strcmp(a, "--steps") == 0)
            bad = duet_config_parse_int(v, 1, INT64_MAX, &steps) != DUET_OK;
        else if (strcmp(a, "--batch") == 0)
            bad = strcmp(v, "0") == 0 ? (n_batch = 0)
                                      : (n_batch = parse_list(v, batch, MAX_LIST)) < 0;
        else if (strcmp(a, "--context") == 0)
            bad = (n_ctx = parse_list(v, ctx, MAX_LIST)) <= 0;
        else if (strcmp(a, "--prefill") == 0)
            bad = strcmp(v, "0") == 0 ? (n_pre = 0) : (n_pre = parse_list(v, pre, MAX_LIST)) < 0;
        else if (strcmp(a, "--verify") == 0)
            bad = (n_vk = parse_list(v, vk, MAX_LIST)) <= 0;
        else if (strcmp(a, "--dtype") == 0)
            bad = strcmp(dtype = v, "bf16") != 0 && strcmp(v, "f32") != 0;
        else if (strcmp(a, "--kv") == 0)
            bad = strcmp(kvdt = v, "bf16") != 0 && strcmp(v, "f32") != 0;
        else {
            fprintf(stderr, "duet-bench-model-cuda: unknown option %s (see --help)\n", a);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "duet-bench-model-cuda: bad value '%s' for %s\n", v, a);
            return 2;
        }
    }
    if (cfg_dir == NULL) {
        fprintf(stderr, "duet-bench-model-cuda: --config DIR is required (see --help)\n");
        return 2;
    }
    if (mixed && n_vk == 0) {
        fprintf(stderr,
                "duet-bench-model-cuda: --mixed shapes the --verify steps: give --verify\n");
        return 2;
    }
    if (n_vk > 0 && n_batch == 0) {
        fprintf(stderr, "duet-bench-model-cuda: --verify measures at the --batch sizes: not with "
                        "--batch 0\n");
        return 2;
    }
    duet_model_config_t cfg;
    if (duet_model_config_load(cfg_dir, &cfg) != DUET_OK) {
        fprintf(stderr, "duet-bench-model-cuda: %s\n", duet_error_last());
        return 1;
    }
    duet_model_config_keep_layers(&cfg, layers);
    if (duet_cuda_device_count() <= 0) {
        fprintf(stderr, "duet-bench-model-cuda: no CUDA device: nothing to measure\n");
        return 0;
    }
    struct cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    double dense, expert, embed;
    count_params(&cfg, &dense, &expert, &embed);
    const double total_params =
        dense + embed + expert * (double)cfg.n_experts * (double)cfg.n_moe_layers;
    const size_t wb = strcmp(dtype, "bf16") == 0 ? 2 : 4, kvb = strcmp(kvdt, "bf16") == 0 ? 2 : 4;

    /* 1. the roofline's bandwidth, and the GEMM rate prefill is compared against */
    double bw = 0;
    if (duet_cuda_copy_bandwidth((size_t)1 << 30, 20, &bw) != DUET_OK) {
        fprintf(stderr, "duet-bench-model-cuda: %s\n", duet_error_last());
        return 1;
    }
    printf("{\"device\":\"%s\",\"layers\":%lld,\"params\":%.0f,\"weights\":\"%s\",\"kv\":\"%s\","
           "\"d2d_GBps\":%.1f}\n",
           prop.name, (long long)cfg.num_layers, total_params, dtype, kvdt, bw / 1e9);
    fflush(stdout);

    int64_t max_b = 1, max_c = 1, max_p = 1;
    for (int i = 0; i < n_batch; i++)
        max_b = batch[i] > max_b ? batch[i] : max_b;
    for (int i = 0; i < n_ctx; i++)
        max_c = ctx[i] > max_c ? ctx[i] : max_c;
    for (int i = 0; i < n_pre; i++)
        max_p = pre[i] > max_p ? pre[i] : max_p;
    int64_t max_k = 0;
    for (int i = 0; i < n_vk; i++)
        max_k = vk[i] > max_k ? vk[i] : max_k;
    const int64_t spec_rows = n_vk > 0 ? max_k + 1 : 0;
    /* a sequence is opened at C + room: the warm-up and timed steps, and a verify item past them */
    const int64_t room = steps + 8 + spec_rows;

    duet_model_opts_t o;
    duet_model_opts_default(&o);
    o.device = DUET_DEVICE_CUDA;
    o.dtype = wb == 2 ? DUET_MODEL_DTYPE_BF16 : DUET_MODEL_DTYPE_F32;
    o.kv_dtype = kvb == 2 ? DUET_DTYPE_BF16 : DUET_DTYPE_F32;
    o.page_tokens = 64;
    o.max_seqs = max_b;
    o.max_seq_len =
        (n_batch > 0 ? max_c : 0) + room + 8 > max_p ? (n_batch > 0 ? max_c : 0) + room + 8 : max_p;
    /* a step carries one prefill, one decode row per sequence, or one verify item per sequence;
     * spec_rows <= max_batch_tokens and <= max_seq_len (model.h) follow */
    o.max_batch_tokens = max_p > max_b * (spec_rows > 0 ? spec_rows : 1)
                             ? max_p
                             : max_b * (spec_rows > 0 ? spec_rows : 1);
    o.spec_rows = spec_rows;
    /* the pool holds max_b sequences of the longest context, or one prefill */
    o.kv_pages = (o.max_seq_len + o.page_tokens - 1) / o.page_tokens * max_b;
    o.tune = tune || tune_file != NULL; /* --tune_file implies --tune */
    o.cuda_graphs = graphs;
    o.tune_file = tune_file;
    double t0 = now_s();
    duet_model_t *m = NULL;
    if (duet_model_create_random(&cfg, &o, 1234, &m) != DUET_OK) {
        fprintf(stderr, "duet-bench-model-cuda: %s\n", duet_error_last());
        return 1;
    }
    fprintf(stderr, "model built in %.1f s\n", now_s() - t0);
    void *kv_dev, *kda_dev;
    size_t kv_bytes, kda_bytes;
    duet_model_device_pools(m, &kv_dev, &kv_bytes, &kda_dev, &kda_bytes);
    /* stand-in context: random KV rows, small random states */
    if ((kv_dev != NULL && duet_cuda_fill_random(0, kv_dev, o.kv_dtype, (int64_t)(kv_bytes / kvb),
                                                 99, 1.0f, 0.0f) != DUET_OK) ||
        (kda_dev != NULL &&
         duet_cuda_fill_random(0, kda_dev, DUET_DTYPE_F32, (int64_t)(kda_bytes / 4), 98, 0.05f,
                               0.0f) != DUET_OK) ||
        cudaDeviceSynchronize() != cudaSuccess) {
        fprintf(stderr, "duet-bench-model-cuda: filling the pools failed: %s\n", duet_error_last());
        return 1;
    }
    const duet_model_config_t *c = duet_model_config(m);
    const double kda_state_bytes =
        (double)c->kda_heads * c->kda_head_dim * c->kda_head_dim * 4.0 +
        3.0 * c->kda_heads * c->kda_head_dim * (c->conv_kernel - 1) * 4.0;
    const double kv_row_bytes = (double)(c->kv_lora_rank + c->qk_rope_head_dim) * (double)kvb;

    /* 2. decode, and verify: its host buffers sized for the largest step, and the KDA state that
     * sequences roll back to between verify measurements */
    int rc = 0;
    const size_t state_bytes = duet_model_seq_state_bytes(m);
    int32_t *vtok = NULL;
    float *vlogits = NULL;
    void *state = NULL;
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    if (n_vk > 0) {
        vtok = malloc(sizeof(int32_t) * (size_t)(2 * max_b * spec_rows)); /* tokens | arg-maxes */
        vlogits = malloc(sizeof(float) * (size_t)(max_b * spec_rows) * (size_t)c->vocab_size);
        state = state_bytes > 0 ? malloc(state_bytes) : NULL;
        if (vtok == NULL || vlogits == NULL || (state_bytes > 0 && state == NULL)) {
            fprintf(stderr, "duet-bench-model-cuda: no host memory for the verify logits\n");
            return 1;
        }
    }
    for (int ic = 0; ic < n_ctx && n_batch > 0; ic++)
        for (int ib = 0; ib < n_batch; ib++) {
            const int64_t B = batch[ib], C = ctx[ic];
            duet_seq_t *seqs = calloc((size_t)B, sizeof(*seqs));
            duet_batch_item_t *items = calloc((size_t)B, sizeof(*items));
            int32_t *tok = calloc((size_t)B, sizeof(int32_t)),
                    *out = calloc((size_t)B, sizeof(int32_t));
            double *ts = calloc((size_t)steps, sizeof(double));
            int ok = 1;
            for (int64_t s = 0; s < B; s++)
                seqs[s].id = -1;
            for (int64_t s = 0; s < B && ok; s++) {
                ok = duet_model_seq_open(m, C + room, &seqs[s]) == DUET_OK &&
                     duet_model_seq_set_filled(m, &seqs[s], C) == DUET_OK;
                tok[s] = (int32_t)((s * 7919) % c->vocab_size);
            }
            if (!ok) {
                fprintf(stderr, "decode B=%lld C=%lld: %s\n", (long long)B, (long long)C,
                        duet_error_last());
                rc = 1;
            }
            /* the KV/state of a fresh sequence was zeroed at open: refill the pools */
            if (ok && ((kv_dev != NULL &&
                        duet_cuda_fill_random(0, kv_dev, o.kv_dtype, (int64_t)(kv_bytes / kvb),
                                              99 + (uint64_t)C, 1.0f, 0.0f) != DUET_OK) ||
                       (kda_dev != NULL &&
                        duet_cuda_fill_random(0, kda_dev, DUET_DTYPE_F32, (int64_t)(kda_bytes / 4),
                                              98, 0.05f, 0.0f) != DUET_OK) ||
                       cudaDeviceSynchronize() != cudaSuccess))
                ok = 0, rc = 1;
            /* every sequence rolls back to seq 0's state at C: their contents are random
             * stand-ins, so any state of the right shape costs the same */
            if (ok && n_vk > 0 && duet_model_seq_state_save(m, &seqs[0], state) != DUET_OK) {
                fprintf(stderr, "verify B=%lld C=%lld: %s\n", (long long)B, (long long)C,
                        duet_error_last());
                ok = 0, rc = 1;
            }
            for (int64_t it = -3; it < steps && ok; it++) {
                for (int64_t s = 0; s < B; s++)
                    items[s] = (duet_batch_item_t){.seq = &seqs[s],
                                                   .tokens = &tok[s],
                                                   .n_tokens = 1,
                                                   .logits_mode = DUET_LOGITS_TOKEN,
                                                   .token_out = &out[s]};
                for (int64_t s = 0; s < B; s++)
                    duet_sampling_default(&items[s].sampling);
                double a = now_s();
                if (duet_model_forward(m, items, B) != DUET_OK) {
                    fprintf(stderr, "decode B=%lld C=%lld: %s\n", (long long)B, (long long)C,
                            duet_error_last());
                    ok = 0, rc = 1;
                    break;
                }
                if (it >= 0)
                    ts[it] = now_s() - a;
                memcpy(tok, out, sizeof(int32_t) * (size_t)B);
            }
            if (ok) {
                qsort(ts, (size_t)steps, sizeof(double), cmp_d);
                const double med = ts[steps / 2];
                const double touched = duet_cuda_moe_touched((double)B, c->top_k, c->n_experts);
                const double w_bytes =
                    (dense + touched * expert * (double)c->n_moe_layers) * (double)wb;
                const double kv =
                    (double)B * (double)(C + steps / 2) * kv_row_bytes * (double)c->n_mla_layers;
                const double st = 2.0 * (double)B * kda_state_bytes * (double)c->n_kda_layers;
                const double bytes = w_bytes + kv + st;
                /* the copy's rate counts bytes read + written: the rate at which the memory
                 * system moves bytes, the same unit as the bytes a step reads or writes */
                const double roof = bytes / bw;
                printf("{\"impl\":\"duet\",\"tuned\":%s,\"layers\":%lld,\"batch\":%lld,\"context\":"
                       "%lld,"
                       "\"step_ms\":%.3f,\"min_ms\":%.3f,\"bytes_GB\":%.3f,\"weights_GB\":%.3f,"
                       "\"kv_GB\":%.3f,\"state_GB\":%.3f,\"roofline_ms\":%.3f,"
                       "\"roofline_frac\":%.3f,\"tok_s\":%.1f,\"graphs\":%s}\n",
                       o.tune ? "true" : "false", (long long)c->num_layers, (long long)B,
                       (long long)C, med * 1e3, ts[0] * 1e3, bytes / 1e9, w_bytes / 1e9, kv / 1e9,
                       st / 1e9, roof * 1e3, roof / med, (double)B / med,
                       graphs ? "true" : "false");
                fflush(stdout);
                fprintf(stderr, "decode B=%lld C=%lld: %.3f ms/step (roofline %.3f ms, %.0f%%)\n",
                        (long long)B, (long long)C, med * 1e3, roof * 1e3, 100.0 * roof / med);
                for (int iv = 0; iv < n_vk; iv++) {
                    const double vs = verify_step_s(m, seqs, B, C, vk[iv], mixed, steps, state,
                                                    items, vtok, vlogits, NULL, ts, &rng);
                    const double va =
                        vs < 0 ? -1
                               : verify_step_s(m, seqs, B, C, vk[iv], mixed, steps, state, items,
                                               vtok, vlogits, vtok + max_b * spec_rows, ts, &rng);
                    if (vs < 0 || va < 0) {
                        rc = 1;
                        break;
                    }
                    /* its roofline: the experts B·(k+1) rows route to, the same KV, the state
                     * read by the verify and read + written by the replay of the accepted row */
                    double vrows = 0; /* the step's rows (verify_step_s) */
                    for (int64_t s = 0; s < B; s++)
                        vrows += (double)(mixed ? s % (vk[iv] + 1) + 1 : vk[iv] + 1);
                    const double vtouched = duet_cuda_moe_touched(vrows, c->top_k, c->n_experts);
                    const double vbytes =
                        (dense + vtouched * expert * (double)c->n_moe_layers) * (double)wb + kv +
                        1.5 * st;
                    printf("{\"bench\":\"verify\",\"layers\":%lld,\"B\":%lld,\"C\":%lld,\"k\":%lld,"
                           "\"ms\":%.3f,\"ms_argmax\":%.3f,\"decode_ms\":%.3f,\"ratio\":%.3f,"
                           "\"ratio_argmax\":%.3f,\"roofline_ms\":%.3f,\"roofline_ratio\":%.3f,"
                           "\"dtype\":\"%s\",\"tuned\":%s,\"mixed\":%s,\"graphs\":%s}\n",
                           (long long)c->num_layers, (long long)B, (long long)C, (long long)vk[iv],
                           vs * 1e3, va * 1e3, med * 1e3, vs / med, va / med, vbytes / bw * 1e3,
                           vbytes / bytes, dtype, o.tune ? "true" : "false",
                           mixed ? "true" : "false", graphs ? "true" : "false");
                    fflush(stdout);
                    fprintf(stderr,
                            "verify B=%lld C=%lld k=%lld: %.3f ms/step, arg-maxes only %.3f "
                            "(%.2fx / %.2fx decode; roofline %.2fx decode's)\n",
                            (long long)B, (long long)C, (long long)vk[iv], vs * 1e3, va * 1e3,
                            vs / med, va / med, vbytes / bytes);
                }
            }
            for (int64_t s = 0; s < B; s++)
                if (seqs[s].id >= 0)
                    duet_model_seq_close(m, &seqs[s]);
            free(seqs);
            free(items);
            free(tok);
            free(out);
            free(ts);
        }
    free(vtok);
    free(vlogits);
    free(state);

    /* 3. prefill, against the GEMM rate of the largest projection at M = P */
    duet_cuda_gemm_t *g = NULL;
    const int64_t N = 3 * c->kda_heads * c->kda_head_dim > c->hidden_size
                          ? 3 * c->kda_heads * c->kda_head_dim
                          : c->hidden_size,
                  Kd = c->hidden_size;
    for (int ip = 0; ip < n_pre && rc == 0; ip++) {
        const int64_t P = pre[ip];
        /* cuBLASLt alone: x already bf16 */
        double gemm_tflops = 0;
        {
            void *x = NULL, *w = NULL;
            float *y = NULL;
            cudaEvent_t e0, e1;
            cudaEventCreate(&e0);
            cudaEventCreate(&e1);
            if (g == NULL && duet_cuda_gemm_create(0, 0, &g) != DUET_OK) {
                fprintf(stderr, "%s\n", duet_error_last());
                return 1;
            }
            if (cudaMalloc(&x, (size_t)(P * Kd) * 2) != cudaSuccess ||
                cudaMalloc(&w, (size_t)(N * Kd) * 2) != cudaSuccess ||
                cudaMalloc((void **)&y, (size_t)(P * N) * 4) != cudaSuccess) {
                fprintf(stderr, "duet-bench-model-cuda: no memory for the GEMM reference\n");
                return 1;
            }
            duet_cuda_fill_random(0, x, DUET_DTYPE_BF16, P * Kd, 5, 1.0f, 0.0f);
            duet_cuda_fill_random(0, w, DUET_DTYPE_BF16, N * Kd, 6, 0.02f, 0.0f);
            duet_tensor_t wt = {.data = w,
                                .dtype = DUET_DTYPE_BF16,
                                .device = DUET_DEVICE_CUDA,
                                .ndim = 2,
                                .shape = {N, Kd}};
            for (int i = 0; i < 3; i++)
                duet_cuda_gemm_matmul_lowp(g, 0, y, N, x, Kd, P, &wt, 0, 0);
            cudaEventRecord(e0, 0);
            for (int i = 0; i < 20; i++)
                duet_cuda_gemm_matmul_lowp(g, 0, y, N, x, Kd, P, &wt, 0, 0);
            cudaEventRecord(e1, 0);
            cudaEventSynchronize(e1);
            float ms = 0;
            cudaEventElapsedTime(&ms, e0, e1);
            gemm_tflops =
                2.0 * (double)P * (double)N * (double)Kd * 20.0 / ((double)ms * 1e-3) / 1e12;
            cudaFree(x);
            cudaFree(w);
            cudaFree(y);
            cudaEventDestroy(e0);
            cudaEventDestroy(e1);
        }
        duet_seq_t seq;
        int32_t *toks = malloc(sizeof(int32_t) * (size_t)P);
        int32_t next = 0;
        for (int64_t t = 0; t < P; t++)
            toks[t] = (int32_t)((t * 31 + 7) % c->vocab_size);
        double best = 1e30;
        int ok = 1;
        for (int rep = 0; rep < 3 && ok; rep++) {
            if (duet_model_seq_open(m, P, &seq) != DUET_OK) {
                fprintf(stderr, "prefill %lld: %s\n", (long long)P, duet_error_last());
                ok = 0, rc = 1;
                break;
            }
            duet_batch_item_t it = {.seq = &seq,
                                    .tokens = toks,
                                    .n_tokens = P,
                                    .logits_mode = DUET_LOGITS_TOKEN,
                                    .token_out = &next};
            duet_sampling_default(&it.sampling);
            double a = now_s();
            if (duet_model_forward(m, &it, 1) != DUET_OK) {
                fprintf(stderr, "prefill %lld: %s\n", (long long)P, duet_error_last());
                ok = 0, rc = 1;
            }
            double dt = now_s() - a;
            if (rep > 0 && dt < best) /* the first run pays the algorithm searches */
                best = dt;
            duet_model_seq_close(m, &seq);
        }
        free(toks);
        if (ok) {
            const double k = (double)c->top_k;
            /* GEMM FLOPs: every token multiplies the dense matrices and k experts */
            const double flops = 2.0 * (double)P * (dense + k * expert * (double)c->n_moe_layers) -
                                 2.0 * (double)P * (double)c->vocab_size * (double)c->hidden_size +
                                 2.0 * (double)c->vocab_size * (double)c->hidden_size;
            printf("{\"impl\":\"duet\",\"tuned\":%s,\"layers\":%lld,\"prefill\":%lld,\"ms\":%.2f,"
                   "\"tok_s\":%.0f,\"gemm_TFLOPs\":%.1f,\"cublaslt_bf16_TFLOPs\":%.1f,"
                   "\"gemm_frac\":%.3f}\n",
                   o.tune ? "true" : "false", (long long)c->num_layers, (long long)P, best * 1e3,
                   (double)P / best, flops / best / 1e12, gemm_tflops,
                   flops / best / 1e12 / gemm_tflops);
            fflush(stdout);
            fprintf(stderr,
                    "prefill %lld: %.1f ms, %.0f tok/s (GEMM part %.1f TFLOP/s; cuBLASLt "
                    "%lldx%lldx%lld %.1f TFLOP/s)\n",
                    (long long)P, best * 1e3, (double)P / best, flops / best / 1e12, (long long)P,
                    (long long)N, (long long)Kd, gemm_tflops);
        }
    }
    duet_cuda_gemm_destroy(g);
    duet_model_free(m);
    return rc;
}
