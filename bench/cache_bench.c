/* What the request-cache benchmarks share; see cache_bench.h. */
#define _GNU_SOURCE
#include "bench/cache_bench.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/cache.h"
#include "tests/unit/st_writer.h"

double cache_bench_now_s(void)
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

double cache_bench_median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(*v), cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int cache_bench_parse_contexts(const char *s, int64_t *ctx, int max, int *n_p)
{
    int n = 0;
    while (*s != '\0') {
        char *end;
        errno = 0;
        long long v = strtoll(s, &end, 10);
        if (errno != 0 || end == s || v <= 0 || v > (1 << 22) || n == max ||
            (*end != ',' && *end != '\0'))
            return -1;
        ctx[n++] = v;
        s = *end == ',' ? end + 1 : end;
    }
    *n_p = n;
    return n > 0 ? 0 : -1;
}

void cache_bench_args_init(cache_bench_args_t *a, const char *src_dir, int reps)
{
    static char demo[512], big[512];
    snprintf(demo, sizeof(demo), "%s/models/duet-demo", src_dir);
    snprintf(big, sizeof(big), "%s/bench/configs/kimi-linear-48b", src_dir);
    *a = (cache_bench_args_t){
        .demo_dir = demo, .big_dir = big, .ctx = {1024, 8192, 32768}, .n_ctx = 3, .reps = reps};
}

int cache_bench_arg(const char *prog, cache_bench_args_t *a, int argc, char **argv, int i)
{
    const char *o = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(o, "--quick") == 0) {
        a->quick = 1;
        return 1;
    }
    if (v == NULL)
        return 0;
    if (strcmp(o, "--reps") == 0) {
        char *end;
        long r = strtol(v, &end, 10);
        if (*end != '\0' || r < 1 || r > CACHE_BENCH_MAX_REPS) {
            fprintf(stderr, "%s: --reps %s: want 1..%d\n", prog, v, CACHE_BENCH_MAX_REPS);
            return -1;
        }
        a->reps = (int)r;
        a->reps_set = 1;
        return 2;
    }
    if (strcmp(o, "--contexts") == 0) {
        if (cache_bench_parse_contexts(v, a->ctx, CACHE_BENCH_MAX_CTX, &a->n_ctx) != 0) {
            fprintf(stderr,
                    "%s: --contexts %s: want up to %d positive token counts, comma-separated\n",
                    prog, v, CACHE_BENCH_MAX_CTX);
            return -1;
        }
        return 2;
    }
    if (strcmp(o, "--demo") == 0 || strcmp(o, "--big") == 0) {
        *(o[2] == 'd' ? &a->demo_dir : &a->big_dir) = v;
        return 2;
    }
    return 0;
}

void cache_bench_args_finish(cache_bench_args_t *a)
{
    if (!a->quick)
        return;
    a->ctx[0] = 1024;
    a->n_ctx = 1;
    if (!a->reps_set)
        a->reps = 3;
}

/* DIR/config.json + model.safetensors: big's cache dimensions, tiny weights (cache_bench.h); the
 * written config into *small_p. 0 on success. */
static int write_small_checkpoint(const char *prog, const duet_model_config_t *big, const char *dir,
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
        fprintf(stderr, "%s: small config: %s\n", prog, duet_error_last());
        return -1;
    }
    for (int64_t l = 0; l < big->num_layers; l++)
        if (small_p->mixer[l] != big->mixer[l] || small_p->ffn[l] != big->ffn[l]) {
            fprintf(stderr, "%s: small config: layer %lld differs\n", prog, (long long)l);
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
        fprintf(stderr, "%s: cannot write the checkpoint in %s\n", prog, dir);
    return rc;
}

int cache_bench_small_checkpoint(const char *prog, const char *big_dir, duet_model_config_t *big_p,
                                 char *dir, size_t cap)
{
    if (duet_model_config_load(big_dir, big_p) != DUET_OK) {
        fprintf(stderr, "%s: %s: %s\n", prog, big_dir, duet_error_last());
        return -1;
    }
    snprintf(dir, cap, "/tmp/duet-cache-bench-XXXXXX");
    if (mkdtemp(dir) == NULL) {
        fprintf(stderr, "%s: mkdtemp %s: %s\n", prog, dir, strerror(errno));
        return -1;
    }
    duet_model_config_t small;
    if (write_small_checkpoint(prog, big_p, dir, &small) != 0) {
        cache_bench_small_checkpoint_remove(dir);
        return -1;
    }
    return 0;
}

void cache_bench_small_checkpoint_remove(const char *dir)
{
    char p[4096];
    snprintf(p, sizeof(p), "%s/model.safetensors", dir);
    unlink(p);
    snprintf(p, sizeof(p), "%s/config.json", dir);
    unlink(p);
    rmdir(dir);
}

int cache_bench_same_cache_dims(duet_model_t *m, const duet_model_config_t *want)
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
