/*
 * spec_test_util.h: what the tests of speculative decoding (test_engine_spec.c,
 * test_engine_generate.c) share. Header-only: static helpers, Criterion asserts; link
 * st_writer.c.
 *  - A one-layer MLA-only checkpoint cut from a model: the draft model of a fixture (or of the
 *    demo model), and the model duet_model_seq_truncate is tested on (a model without KDA layers
 *    is the only kind that rolls back). Layer 0 of the cut is the source's first MLA layer, its
 *    attention and its MLP (dense or MoE) bit for bit, under the source's embedding, final norm
 *    and LM head, so it shares the source's vocabulary and agrees with it part of the time, as a
 *    draft model should. Written as config.json + model.safetensors (st_writer) into a fresh
 *    folder in /tmp.
 *  - A copy of a sequence's caches in a new sequence, filled as a cache transfer fills one.
 */
#ifndef DUET_TESTS_SPEC_TEST_UTIL_H
#define DUET_TESTS_SPEC_TEST_UTIL_H

#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/cache.h"
#include "engine/checkpoint.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "kernels/kernels.h"

#include "st_writer.h"

/* Cut `src`'s first MLA layer into a one-layer checkpoint; its folder (in /tmp) into dir. */
static void mla_only_make(const char *src, char *dir, size_t cap)
{
    duet_model_config_t cfg;
    cr_assert_eq(duet_model_config_load(src, &cfg), DUET_OK, "%s", duet_error_last());
    int64_t layer = -1;
    for (int64_t l = 0; l < cfg.num_layers && layer < 0; l++)
        if (cfg.mixer[l] == DUET_MIXER_MLA)
            layer = l;
    cr_assert_geq(layer, 0, "%s has no MLA layer to cut", src);

    snprintf(dir, cap, "/tmp/duet_mla_only_XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    /* the source's config with one layer; the explicit lists win over the hub's spelling */
    char path[4096];
    snprintf(path, sizeof(path), "%s/config.json", src);
    json_error_t jerr;
    json_t *c = json_load_file(path, 0, &jerr);
    cr_assert_not_null(c, "%s: %s", path, jerr.text);
    json_object_set_new(c, "num_hidden_layers", json_integer(1));
    json_object_set_new(c, "layer_types", json_pack("[s]", "full_attention"));
    json_object_set_new(c, "mlp_layer_types",
                        json_pack("[s]", cfg.ffn[layer] == DUET_FFN_MOE ? "sparse" : "dense"));
    snprintf(path, sizeof(path), "%s/config.json", dir);
    cr_assert_eq(json_dump_file(c, path, JSON_INDENT(2)), 0);
    json_decref(c);

    /* the tensors outside the layers as they are, layer `layer`'s as layer 0's */
    duet_checkpoint_t *ck = NULL;
    cr_assert_eq(duet_checkpoint_open(src, &ck), DUET_OK, "%s", duet_error_last());
    st_writer_t *w = st_writer_new();
    cr_assert_not_null(w);
    char prefix[64];
    snprintf(prefix, sizeof(prefix), "model.layers.%lld.", (long long)layer);
    int n_layer = 0;
    for (int64_t i = 0; i < duet_checkpoint_n_tensors(ck); i++) {
        const char *name = duet_checkpoint_tensor_name(ck, i);
        char renamed[512];
        if (strncmp(name, "model.layers.", 13) != 0)
            snprintf(renamed, sizeof(renamed), "%s", name);
        else if (strncmp(name, prefix, strlen(prefix)) == 0) {
            snprintf(renamed, sizeof(renamed), "model.layers.0.%s", name + strlen(prefix));
            n_layer++;
        } else
            continue;
        duet_tensor_t t;
        cr_assert_eq(duet_checkpoint_get(ck, name, &t), DUET_OK, "%s", duet_error_last());
        cr_assert_eq(st_writer_add(w, renamed, duet_dtype_name(t.dtype), t.ndim, t.shape, t.data),
                     0);
    }
    cr_assert_gt(n_layer, 0, "%s: no tensor of layer %lld", src, (long long)layer);
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    cr_assert_eq(st_writer_write(w, path), 0, "cannot write %s", path);
    st_writer_free(w);
    duet_checkpoint_close(ck);
}

static void mla_only_remove(const char *dir)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/config.json", dir);
    unlink(path);
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    unlink(path);
    rmdir(dir);
}

/* The bytes of a KDA state slot: every KDA layer's S and conv windows (0 without KDA layers). */
static size_t kda_slot_bytes(duet_model_t *m)
{
    duet_kda_pool_t *p = duet_model_kda_pool(m);
    return p == NULL ? 0 : duet_kda_pool_layer_bytes(p) * (size_t)duet_kda_pool_desc(p)->n_layers;
}

/* Every KDA layer's S and conv windows of the sequence (a slot's layers are contiguous). */
static const uint8_t *kda_slot(duet_model_t *m, const duet_seq_t *s)
{
    return (const uint8_t *)duet_kda_pool_state(duet_model_kda_pool(m), s->kda_slot, 0);
}

/* A new sequence holding a copy of `src`'s caches (src has nothing to replay), filled as a cache
 * transfer fills one. */
static void clone_seq(duet_model_t *m, const duet_seq_t *src, int64_t cap, duet_seq_t *dst)
{
    cr_assert_eq(src->n_replay, 0);
    cr_assert_eq(duet_model_seq_open(m, cap, dst), DUET_OK, "%s", duet_error_last());
    duet_kv_pool_t *kv = duet_model_kv_pool(m);
    if (kv != NULL) {
        const int64_t PT = duet_kv_pool_desc(kv)->page_tokens;
        for (int64_t pg = 0; pg < (src->n_tokens + PT - 1) / PT; pg++)
            for (int64_t l = 0; l < duet_kv_pool_desc(kv)->n_layers; l++)
                memcpy(duet_kv_pool_block(kv, dst->pages[pg], l),
                       duet_kv_pool_block(kv, src->pages[pg], l), duet_kv_pool_block_bytes(kv));
    }
    if (duet_model_kda_pool(m) != NULL)
        memcpy((void *)kda_slot(m, dst), kda_slot(m, src), kda_slot_bytes(m));
    cr_assert_eq(duet_model_seq_set_filled(m, dst, src->n_tokens), DUET_OK, "%s",
                 duet_error_last());
    cr_assert(dst->n_pending == 0 && dst->n_replay == 0, "a filled sequence has nothing pending");
}

#endif
