/*
 * spec_test_util.h: what the tests of speculative decoding (test_engine_spec.c,
 * test_engine_generate.c) share. Header-only: static helpers, Criterion asserts; link
 * st_writer.c.
 *  - Draft models cut from a model (a fixture or the demo model): the source's layers, each one's
 *    mixer and MLP (dense or MoE) bit for bit, under the source's embedding, final norm and LM
 *    head, so a cut shares the source's vocabulary and agrees with it part of the time, as a draft
 *    model should. Two cuts: the first MLA layer alone (MLA-only: rolls back by truncating), and
 *    the first KDA layer then the first MLA layer (a drafter with KDA: rolls back by restoring a
 *    saved state). Written as config.json + model.safetensors (st_writer) into a fresh folder in
 *    /tmp.
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

/* The index of src's first layer with mixer `mx`; -1 when none. */
static inline int64_t first_layer_of(const duet_model_config_t *cfg, duet_mixer_kind_t mx)
{
    for (int64_t l = 0; l < cfg->num_layers; l++)
        if (cfg->mixer[l] == mx)
            return l;
    return -1;
}

/* Cut src's layers layers[0..n) into an n-layer checkpoint (layer i of the cut = source layer
 * layers[i], mixer and MLP bit for bit); its folder (in /tmp) into dir. */
static void layers_cut_make(const char *src, const int64_t *layers, int n, char *dir, size_t cap)
{
    duet_model_config_t cfg;
    cr_assert_eq(duet_model_config_load(src, &cfg), DUET_OK, "%s", duet_error_last());
    snprintf(dir, cap, "/tmp/duet_draft_cut_XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    /* the source's config with n layers; the explicit lists win over the hub's spelling */
    char path[4096];
    snprintf(path, sizeof(path), "%s/config.json", src);
    json_error_t jerr;
    json_t *c = json_load_file(path, 0, &jerr);
    cr_assert_not_null(c, "%s: %s", path, jerr.text);
    json_t *lt = json_array(), *mt = json_array();
    for (int i = 0; i < n; i++) {
        cr_assert(layers[i] >= 0 && layers[i] < cfg.num_layers);
        json_array_append_new(lt, json_string(cfg.mixer[layers[i]] == DUET_MIXER_KDA
                                                  ? "linear_attention"
                                                  : "full_attention"));
        json_array_append_new(mt,
                              json_string(cfg.ffn[layers[i]] == DUET_FFN_MOE ? "sparse" : "dense"));
    }
    json_object_set_new(c, "num_hidden_layers", json_integer(n));
    json_object_set_new(c, "layer_types", lt);
    json_object_set_new(c, "mlp_layer_types", mt);
    snprintf(path, sizeof(path), "%s/config.json", dir);
    cr_assert_eq(json_dump_file(c, path, JSON_INDENT(2)), 0);
    json_decref(c);

    /* the tensors outside the layers as they are, layer layers[i]'s as layer i's */
    duet_checkpoint_t *ck = NULL;
    cr_assert_eq(duet_checkpoint_open(src, &ck), DUET_OK, "%s", duet_error_last());
    st_writer_t *w = st_writer_new();
    cr_assert_not_null(w);
    int n_layer[8] = {0};
    cr_assert_leq(n, 8);
    for (int64_t t = 0; t < duet_checkpoint_n_tensors(ck); t++) {
        const char *name = duet_checkpoint_tensor_name(ck, t);
        char renamed[512] = "";
        if (strncmp(name, "model.layers.", 13) != 0)
            snprintf(renamed, sizeof(renamed), "%s", name);
        for (int i = 0; i < n && renamed[0] == '\0'; i++) {
            char prefix[64];
            snprintf(prefix, sizeof(prefix), "model.layers.%lld.", (long long)layers[i]);
            if (strncmp(name, prefix, strlen(prefix)) == 0) {
                snprintf(renamed, sizeof(renamed), "model.layers.%d.%s", i, name + strlen(prefix));
                n_layer[i]++;
            }
        }
        if (renamed[0] == '\0')
            continue;
        duet_tensor_t tt;
        cr_assert_eq(duet_checkpoint_get(ck, name, &tt), DUET_OK, "%s", duet_error_last());
        cr_assert_eq(
            st_writer_add(w, renamed, duet_dtype_name(tt.dtype), tt.ndim, tt.shape, tt.data), 0);
    }
    for (int i = 0; i < n; i++)
        cr_assert_gt(n_layer[i], 0, "%s: no tensor of layer %lld", src, (long long)layers[i]);
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    cr_assert_eq(st_writer_write(w, path), 0, "cannot write %s", path);
    st_writer_free(w);
    duet_checkpoint_close(ck);
}

/* Cut `src`'s first MLA layer into a one-layer checkpoint; its folder (in /tmp) into dir. */
static void mla_only_make(const char *src, char *dir, size_t cap)
{
    duet_model_config_t cfg;
    cr_assert_eq(duet_model_config_load(src, &cfg), DUET_OK, "%s", duet_error_last());
    const int64_t layer = first_layer_of(&cfg, DUET_MIXER_MLA);
    cr_assert_geq(layer, 0, "%s has no MLA layer to cut", src);
    layers_cut_make(src, &layer, 1, dir, cap);
}

/* Cut `src`'s first KDA layer, then its first MLA layer, into a two-layer drafter with KDA (the
 * MLA layer then sees positions through the KDA layer's recurrence, as in the source); its
 * folder (in /tmp) into dir. 0 (nothing made) when src lacks either kind. */
static inline int kda_mla_make(const char *src, char *dir, size_t cap)
{
    duet_model_config_t cfg;
    cr_assert_eq(duet_model_config_load(src, &cfg), DUET_OK, "%s", duet_error_last());
    const int64_t layers[2] = {first_layer_of(&cfg, DUET_MIXER_KDA),
                               first_layer_of(&cfg, DUET_MIXER_MLA)};
    if (layers[0] < 0 || layers[1] < 0)
        return 0;
    layers_cut_make(src, layers, 2, dir, cap);
    return 1;
}

/* Remove a folder mla_only_make / kda_mla_make made. */
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
