/*
 * backend.c: what every backend shares (contract in backend.h): the table of backends, the layer
 * hook's index mapping, and the fp32 parameters converted once from a checkpoint.
 */
#include "engine/backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

/* --device auto's order of preference. */
static const duet_backend_ops_t *const duet__backends[] = {&duet_backend_cuda_ops,
                                                           &duet_backend_cpu_ops};
#define DUET__N_BACKENDS (sizeof(duet__backends) / sizeof(duet__backends[0]))

const duet_backend_ops_t *duet_backend_find(duet_device_kind_t dev)
{
    for (size_t i = 0; i < DUET__N_BACKENDS; i++)
        if (duet__backends[i]->device == dev)
            return duet__backends[i];
    return NULL;
}

const duet_backend_ops_t *duet_backend_find_name(const char *name)
{
    for (size_t i = 0; name != NULL && i < DUET__N_BACKENDS; i++)
        if (strcmp(duet__backends[i]->name, name) == 0)
            return duet__backends[i];
    return NULL;
}

const duet_backend_ops_t *duet_backend_pick_auto(void)
{
    char why[256];
    for (size_t i = 0; i < DUET__N_BACKENDS; i++) {
        why[0] = '\0';
        int ok = duet__backends[i]->probe(why, sizeof(why));
        if (ok > 0)
            return duet__backends[i];
        if (ok < 0) /* a device this build cannot use: say why the next one runs */
            DUET_LOG_WARN("--device auto: %s; trying the next backend", why);
    }
    return &duet_backend_cpu_ops; /* its probe always says yes */
}

void duet_backend_layer_done(const duet_backend_model_t *bm, const duet_backend_batch_t *b,
                             int64_t l)
{
    if (b->hook == NULL)
        return;
    const int kda = bm->cfg->mixer[l] == DUET_MIXER_KDA;
    b->hook(b->hook_user, l, kda ? -1 : bm->layer_sub[l], kda ? bm->layer_sub[l] : -1);
}

static float *duet__to_f32(const duet_tensor_t *t)
{
    int64_t n = duet_tensor_numel(t);
    float *p = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (p != NULL)
        duet_convert_to_f32(p, t->data, t->dtype, n);
    return p;
}

void duet_backend_f32_free(const duet_model_config_t *cfg, duet_backend_f32_t *f32)
{
    if (f32 == NULL)
        return;
    for (int64_t l = 0; l < cfg->num_layers; l++) {
        free(f32[l].conv_w);
        free(f32[l].dt_bias);
        free(f32[l].neg_A);
        free(f32[l].o_norm);
        free(f32[l].wuk_t);
        free(f32[l].moe_bias);
    }
    free(f32);
}

duet_status_t duet_backend_f32_prepare(const duet_model_config_t *c, const duet_weights_t *w,
                                       duet_backend_f32_t **f32_p)
{
    const int64_t HK = c->kda_heads * c->kda_head_dim, W = c->conv_kernel;
    duet_backend_f32_t *f = calloc((size_t)c->num_layers, sizeof(*f));
    if (f == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "model: out of memory");
    for (int64_t l = 0; l < c->num_layers; l++) {
        const duet_layer_weights_t *lw = &w->layers[l];
        duet_backend_f32_t *lf = &f[l];
        if (c->mixer[l] == DUET_MIXER_KDA) {
            lf->conv_w = malloc(sizeof(float) * (size_t)(3 * HK * W));
            lf->dt_bias = duet__to_f32(&lw->kda.dt_bias);
            lf->neg_A = duet__to_f32(&lw->kda.A_log);
            lf->o_norm = duet__to_f32(&lw->kda.o_norm);
            if (lf->conv_w == NULL || lf->dt_bias == NULL || lf->neg_A == NULL ||
                lf->o_norm == NULL)
                goto nomem;
            duet_convert_to_f32(lf->conv_w, lw->kda.q_conv.data, lw->kda.q_conv.dtype, HK * W);
            duet_convert_to_f32(lf->conv_w + HK * W, lw->kda.k_conv.data, lw->kda.k_conv.dtype,
                                HK * W);
            duet_convert_to_f32(lf->conv_w + 2 * HK * W, lw->kda.v_conv.data, lw->kda.v_conv.dtype,
                                HK * W);
            for (int64_t h = 0; h < c->kda_heads; h++)
                lf->neg_A[h] = -expf(lf->neg_A[h]);
        } else {
            const int64_t n = c->mla_heads, dn = c->qk_nope_head_dim, dv = c->v_head_dim,
                          r = c->kv_lora_rank;
            float *kvb = duet__to_f32(&lw->mla.kv_b_proj); /* (n*(dn+dv), r) */
            lf->wuk_t = malloc(sizeof(float) * (size_t)(n * r * dn));
            if (kvb == NULL || lf->wuk_t == NULL) {
                free(kvb);
                goto nomem;
            }
            for (int64_t h = 0; h < n; h++)
                for (int64_t i = 0; i < dn; i++)
                    for (int64_t j = 0; j < r; j++)
                        lf->wuk_t[(h * r + j) * dn + i] = kvb[(h * (dn + dv) + i) * r + j];
            free(kvb);
        }
        if (c->ffn[l] == DUET_FFN_MOE) {
            lf->moe_bias = duet__to_f32(&lw->moe.gate_bias);
            if (lf->moe_bias == NULL)
                goto nomem;
        }
    }
    *f32_p = f;
    return DUET_OK;

nomem:
    duet_backend_f32_free(c, f);
    return DUET_FAIL(DUET_ERR_NOMEM, "model: out of memory");
}
