/*
 * duet-bench-suspend: what suspending and resuming a request costs on the CPU (issue 37). A
 * generation worker out of pages suspends a request (duet_model_seq_snapshot_save, then close)
 * and resumes it later (open, then duet_model_seq_snapshot_restore); both are copies of the
 * request's cache, so the question is how close they come to memcpy of the same bytes.
 *
 * Two models: the demo model (models/duet-demo, loaded as it is) and one with Kimi-Linear-48B's
 * cache dimensions (bench/configs/kimi-linear-48b: its layer pattern, MLA latent kv_lora_rank +
 * qk_rope_head_dim, KDA heads, head dim and conv kernel) but tiny weights, written to a
 * temporary checkpoint at start: only the cache's bytes matter here, and the CPU backend loads
 * weights from a checkpoint only. The sequence is filled with duet_model_seq_set_filled over a
 * byte pattern (no prefill: the copies do not depend on the values), and each resume is checked
 * to give back the suspended bytes.
 *
 *   duet-bench-suspend [--quick] [--reps N] [--contexts 1024,8192,32768] [--demo DIR] [--big DIR]
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/version.h"
#include "engine/cache.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "tests/unit/st_writer.h"

#define MAX_CTX  8
#define MAX_REPS 64

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(*v), cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/*
 * Write DIR/config.json + model.safetensors: big's cache dimensions (layer pattern, MLA latent,
 * KDA heads / head dim / conv kernel) with everything that only sizes weights shrunk (hidden 64,
 * vocab 256, one MLA head, dense 64 / expert 32 wide, 2 experts top-1). The resulting config is
 * returned in *small_p. 0 on success.
 */
static int write_small_checkpoint(const duet_model_config_t *big, const char *dir,
                                  duet_model_config_t *small_p)
{
    char kda[1024] = "", mla[1024] = "";
    size_t nk = 0, nm = 0;
    int64_t first_dense = 0;
    while (first_dense < big->num_layers && big->ffn[first_dense] == DUET_FFN_DENSE)
        first_dense++;
    for (int64_t l = 0; l < big->num_layers; l++) {
        char *s = big->mixer[l] == DUET_MIXER_KDA ? kda : mla;
        size_t *n = big->mixer[l] == DUET_MIXER_KDA ? &nk : &nm;
        *n += (size_t)snprintf(s + *n, sizeof(kda) - *n, "%s%lld", *n ? ", " : "",
                               (long long)(l + 1));
    }
    char json[4096];
    snprintf(json, sizeof(json),
             "{\"model_type\": \"kimi_linear\", \"vocab_size\": 256, \"hidden_size\": 64,\n"
             " \"num_hidden_layers\": %lld, \"intermediate_size\": 64,\n"
             " \"moe_intermediate_size\": 32, \"num_experts\": 2, \"num_experts_per_token\": 1,\n"
             " \"num_shared_experts\": 1, \"first_k_dense_replace\": %lld, \"moe_layer_freq\": 1,\n"
             " \"num_attention_heads\": 1, \"num_key_value_heads\": 1, \"q_lora_rank\": null,\n"
             " \"kv_lora_rank\": %lld, \"qk_nope_head_dim\": %lld, \"qk_rope_head_dim\": %lld,\n"
             " \"v_head_dim\": %lld, \"mla_use_nope\": true,\n"
             " \"linear_attn_config\": {\"full_attn_layers\": [%s], \"kda_layers\": [%s],\n"
             "   \"head_dim\": %lld, \"num_heads\": %lld, \"short_conv_kernel_size\": %lld},\n"
             " \"num_expert_group\": 1, \"topk_group\": 1, \"hidden_act\": \"silu\",\n"
             " \"tie_word_embeddings\": false, \"torch_dtype\": \"float32\"}\n",
             (long long)big->num_layers, (long long)first_dense, (long long)big->kv_lora_rank,
             (long long)big->qk_nope_head_dim, (long long)big->qk_rope_head_dim,
             (long long)big->v_head_dim, mla, kda, (long long)big->kda_head_dim,
             (long long)big->kda_heads, (long long)big->conv_kernel);
    if (duet_model_config_parse(json, strlen(json), "small config", small_p) != DUET_OK) {
        fprintf(stderr, "duet-bench-suspend: small config: %s\n", duet_error_last());
        return -1;
    }
    for (int64_t l = 0; l < big->num_layers; l++)
        if (small_p->mixer[l] != big->mixer[l] || small_p->ffn[l] != big->ffn[l]) {
            fprintf(stderr, "duet-bench-suspend: small config: layer %lld differs\n", (long long)l);
            return -1;
        }
    char path[4096];
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    st_writer_t *w = st_writer_new();
    int rc = w == NULL || st_writer_add_model(w, small_p, "F32", 37) != 0 ||
                     st_writer_write(w, path) != 0 || st_write_text(dir, "config.json", json) != 0
                 ? -1
                 : 0;
    st_writer_free(w);
    if (rc != 0)
        fprintf(stderr, "duet-bench-suspend: cannot write the checkpoint in %s\n", dir);
    return rc;
}

/* The cache pools of the loaded model have the dimensions `want` (the 48B config) gives them. */
static int same_cache_dims(duet_model_t *m, const duet_model_config_t *want)
{
    duet_kv_pool_desc_t kv;
    duet_kda_pool_desc_t kd;
    duet_replay_pool_desc_t rp;
    duet_model_pool_descs(want, duet_model_opts(m), &kv, &kd, &rp);
    const duet_kv_pool_desc_t *hk =
        duet_model_kv_pool(m) != NULL ? duet_kv_pool_desc(duet_model_kv_pool(m)) : NULL;
    const duet_kda_pool_desc_t *hd =
        duet_model_kda_pool(m) != NULL ? duet_kda_pool_desc(duet_model_kda_pool(m)) : NULL;
    return hk != NULL && hd != NULL && hk->n_layers == kv.n_layers &&
           hk->token_dim == kv.token_dim && hk->dtype == kv.dtype && hk->n_pages == kv.n_pages &&
           hd->n_layers == kd.n_layers && hd->heads == kd.heads && hd->head_dim == kd.head_dim &&
           hd->conv_kernel == kd.conv_kernel;
}

/* Every byte of both pools gets a position-dependent value, so a resume that lost or moved
 * bytes shows up in the check, and no page is left untouched (zero-page mapping). */
static void fill_pattern(duet_model_t *m)
{
    if (duet_model_kv_pool(m) != NULL) {
        uint8_t *p = duet_kv_pool_base(duet_model_kv_pool(m));
        const size_t n = duet_kv_pool_bytes(duet_model_kv_pool(m));
        for (size_t i = 0; i < n; i++)
            p[i] = (uint8_t)(i * 131u + (i >> 12));
    }
    if (duet_model_kda_pool(m) != NULL) {
        uint8_t *p = duet_kda_pool_base(duet_model_kda_pool(m));
        const size_t n = duet_kda_pool_bytes(duet_model_kda_pool(m));
        for (size_t i = 0; i < n; i++)
            p[i] = (uint8_t)(i * 197u + (i >> 10) + 7u);
    }
}

/* One model, one context: median times of `reps` suspend / resume cycles and of memcpy. */
static int bench_one(duet_model_t *m, const char *label, int64_t ctx, int reps)
{
    const size_t bytes = duet_model_seq_snapshot_bytes(m, ctx);
    uint8_t *buf = malloc(bytes), *chk = malloc(bytes), *dst = malloc(bytes);
    duet_seq_t seq = {.id = -1};
    int rc = -1;
    if (buf == NULL || chk == NULL || dst == NULL) {
        fprintf(stderr, "duet-bench-suspend: no memory for %zu-byte buffers\n", bytes);
        goto done;
    }
    memset(buf, 1, bytes);
    memset(chk, 2, bytes);
    memset(dst, 3, bytes);
    if (duet_model_seq_open(m, ctx, &seq) != DUET_OK)
        goto fail;
    fill_pattern(m);
    if (duet_model_seq_set_filled(m, &seq, ctx) != DUET_OK ||
        duet_model_seq_snapshot_save(m, &seq, chk) != DUET_OK)
        goto fail;
    double t_save[MAX_REPS], t_close[MAX_REPS], t_open[MAX_REPS], t_rest[MAX_REPS],
        t_resume[MAX_REPS], t_cpy[MAX_REPS];
    for (int r = 0; r < reps; r++) {
        double t0 = now_s();
        if (duet_model_seq_snapshot_save(m, &seq, buf) != DUET_OK)
            goto fail;
        double t1 = now_s();
        duet_model_seq_close(m, &seq);
        double t2 = now_s();
        if (duet_model_seq_open(m, ctx, &seq) != DUET_OK)
            goto fail;
        double t3 = now_s();
        if (duet_model_seq_snapshot_restore(m, &seq, buf, ctx) != DUET_OK)
            goto fail;
        double t4 = now_s();
        memcpy(dst, buf, bytes);
        double t5 = now_s();
        t_save[r] = t1 - t0;
        t_close[r] = t2 - t1;
        t_open[r] = t3 - t2;
        t_rest[r] = t4 - t3;
        t_resume[r] = t4 - t2;
        t_cpy[r] = t5 - t4;
        if (memcmp(buf, chk, bytes) != 0 || memcmp(dst, chk, bytes) != 0) {
            fprintf(stderr, "duet-bench-suspend: %s at %lld tokens: the snapshot changed\n", label,
                    (long long)ctx);
            goto done;
        }
    }
    /* the last resume left the sequence holding exactly the first snapshot's bytes */
    if (duet_model_seq_snapshot_save(m, &seq, dst) != DUET_OK)
        goto fail;
    if (memcmp(dst, chk, bytes) != 0) {
        fprintf(stderr, "duet-bench-suspend: %s at %lld tokens: resume lost bytes\n", label,
                (long long)ctx);
        goto done;
    }
    const double gb = (double)bytes / 1e9, save = median(t_save, reps),
                 close = median(t_close, reps), open = median(t_open, reps),
                 rest = median(t_rest, reps), resume = median(t_resume, reps),
                 cpy = median(t_cpy, reps);
    printf("| %s | %lld | %.1f | %.2f (%.1f) | %.3f | %.2f | %.2f (%.1f) | %.2f (%.1f) | %.2f "
           "(%.1f) |\n",
           label, (long long)ctx, (double)bytes / 1048576.0, save * 1e3, gb / save, close * 1e3,
           open * 1e3, rest * 1e3, gb / rest, resume * 1e3, gb / resume, cpy * 1e3, gb / cpy);
    fflush(stdout);
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "duet-bench-suspend: %s at %lld tokens: %s\n", label, (long long)ctx,
            duet_error_last());
done:
    if (seq.id >= 0)
        duet_model_seq_close(m, &seq);
    free(buf);
    free(chk);
    free(dst);
    return rc;
}

static int bench_model(duet_model_t *m, const char *label, const int64_t *ctx, int n_ctx, int reps)
{
    for (int i = 0; i < n_ctx; i++)
        if (bench_one(m, label, ctx[i], reps) != 0)
            return -1;
    return 0;
}

static void opts_for(duet_model_opts_t *o, int64_t max_ctx)
{
    duet_model_opts_default(o);
    o->n_threads = 1; /* the copies are single-threaded; the forward pass never runs */
    o->max_seqs = 1;
    o->max_seq_len = max_ctx;
    o->max_batch_tokens = 16;
}

static int parse_contexts(const char *s, int64_t *ctx, int *n_p)
{
    int n = 0;
    while (*s != '\0') {
        char *end;
        errno = 0;
        long long v = strtoll(s, &end, 10);
        if (errno != 0 || end == s || v <= 0 || v > (1 << 22) || n == MAX_CTX ||
            (*end != ',' && *end != '\0'))
            return -1;
        ctx[n++] = v;
        s = *end == ',' ? end + 1 : end;
    }
    *n_p = n;
    return n > 0 ? 0 : -1;
}

int main(int argc, char **argv)
{
    const char *demo_dir = DUET_SOURCE_DIR "/models/duet-demo";
    const char *big_dir = DUET_SOURCE_DIR "/bench/configs/kimi-linear-48b";
    int64_t ctx[MAX_CTX] = {1024, 8192, 32768};
    int n_ctx = 3, reps = 7, quick = 0, reps_set = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (duet_version_flag(a)) {
            duet_version_print("duet-bench-suspend");
            return 0;
        }
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            printf("usage: duet-bench-suspend [--quick] [--reps N] [--contexts 1024,8192,32768]\n"
                   "                          [--demo DIR] [--big DIR]\n"
                   "Time to suspend (snapshot save + close) and resume (open + snapshot restore)\n"
                   "a request on the CPU, at each context length, for the demo model (--demo,\n"
                   "default models/duet-demo) and for a model with the cache dimensions of\n"
                   "--big's config.json (default bench/configs/kimi-linear-48b) and tiny\n"
                   "weights, against memcpy of the same bytes; medians of --reps runs (7).\n"
                   "Prints a markdown table. --quick: 1024 tokens, 3 runs.\n");
            return 0;
        }
        if (strcmp(a, "--quick") == 0) {
            quick = 1;
        } else if (strcmp(a, "--reps") == 0 && v != NULL) {
            char *end;
            long r = strtol(v, &end, 10);
            if (*end != '\0' || r < 1 || r > MAX_REPS) {
                fprintf(stderr, "duet-bench-suspend: --reps %s: want 1..%d\n", v, MAX_REPS);
                return 2;
            }
            reps = (int)r;
            reps_set = 1;
            i++;
        } else if (strcmp(a, "--contexts") == 0 && v != NULL) {
            if (parse_contexts(v, ctx, &n_ctx) != 0) {
                fprintf(stderr,
                        "duet-bench-suspend: --contexts %s: want up to %d positive token "
                        "counts, comma-separated\n",
                        v, MAX_CTX);
                return 2;
            }
            i++;
        } else if (strcmp(a, "--demo") == 0 && v != NULL) {
            demo_dir = v;
            i++;
        } else if (strcmp(a, "--big") == 0 && v != NULL) {
            big_dir = v;
            i++;
        } else {
            fprintf(stderr,
                    "duet-bench-suspend: unknown option or missing value: %s (see --help)\n", a);
            return 2;
        }
    }
    if (quick) {
        ctx[0] = 1024;
        n_ctx = 1;
        if (!reps_set)
            reps = 3;
    }
    int64_t max_ctx = 0;
    for (int i = 0; i < n_ctx; i++)
        max_ctx = ctx[i] > max_ctx ? ctx[i] : max_ctx;
    if (getenv("DUET_LOG_LEVEL") == NULL)
        duet_log_set_level(DUET_LOG_LEVEL_WARN);

    int rc = 1;
    duet_model_t *m = NULL;
    char tmp[] = "/tmp/duet-bench-suspend-XXXXXX";
    int have_tmp = 0;
    duet_model_opts_t o;
    opts_for(&o, max_ctx);

    printf("Medians of %d runs; times in ms, (GB/s) = snapshot bytes / time. suspend = save + "
           "close, resume = open + restore.\n\n",
           reps);
    printf("| model | context | snapshot MiB | save ms (GB/s) | close ms | open ms | restore ms "
           "(GB/s) | open + restore ms (GB/s) | memcpy ms (GB/s) |\n");
    printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    fflush(stdout);

    if (duet_model_load(demo_dir, &o, &m) != DUET_OK) {
        fprintf(stderr, "duet-bench-suspend: %s: %s\n", demo_dir, duet_error_last());
        goto done;
    }
    if (bench_model(m, "demo", ctx, n_ctx, reps) != 0)
        goto done;
    duet_model_free(m);
    m = NULL;

    duet_model_config_t big, small;
    if (duet_model_config_load(big_dir, &big) != DUET_OK) {
        fprintf(stderr, "duet-bench-suspend: %s: %s\n", big_dir, duet_error_last());
        goto done;
    }
    if (mkdtemp(tmp) == NULL) {
        fprintf(stderr, "duet-bench-suspend: mkdtemp %s: %s\n", tmp, strerror(errno));
        goto done;
    }
    have_tmp = 1;
    if (write_small_checkpoint(&big, tmp, &small) != 0)
        goto done;
    if (duet_model_load(tmp, &o, &m) != DUET_OK) {
        fprintf(stderr, "duet-bench-suspend: the small checkpoint: %s\n", duet_error_last());
        goto done;
    }
    if (!same_cache_dims(m, &big)) {
        fprintf(stderr, "duet-bench-suspend: the small model's cache differs from %s's\n", big_dir);
        goto done;
    }
    if (bench_model(m, "48B cache", ctx, n_ctx, reps) != 0)
        goto done;
    rc = 0;
done:
    duet_model_free(m);
    if (have_tmp) {
        char p[4096];
        snprintf(p, sizeof(p), "%s/model.safetensors", tmp);
        unlink(p);
        snprintf(p, sizeof(p), "%s/config.json", tmp);
        unlink(p);
        rmdir(tmp);
    }
    return rc;
}
