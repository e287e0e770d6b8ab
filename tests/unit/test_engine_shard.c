/*
 * The cut of a Helix generation group (engine/shard.h): the cuts themselves against their
 * definitions, the page and token counts against a brute-force dealing of pages, the rank's
 * weights against the whole checkpoint's bytes, and the refusals. The group's forward against the
 * single-process model is tests/group/test_engine_group.c (MPI ranks).
 */
#include <criterion/criterion.h>
#include <string.h>

#include "engine/checkpoint.h"
#include "engine/model.h"
#include "engine/shard.h"
#include "kernels/cpu/cpu_mla.h"

#define DEMO DUET_SOURCE_DIR "/models/duet-demo"

static duet_model_config_t demo_cfg(void)
{
    duet_model_config_t c;
    cr_assert_eq(duet_model_config_load(DEMO, &c), DUET_OK, "%s", duet_error_last());
    return c;
}

Test(engine_shard, cuts_cover_every_head_row_and_expert_once)
{
    const duet_model_config_t c = demo_cfg();
    const int shapes[][2] = {{1, 1}, {2, 1}, {1, 2}, {2, 2}, {4, 1}, {1, 4}};
    for (size_t k = 0; k < sizeof(shapes) / sizeof(shapes[0]); k++) {
        const int cp = shapes[k][0], tp = shapes[k][1], n = cp * tp;
        int64_t kda = 0, mlp = 0, shr = 0, exp = 0, own[64] = {0};
        for (int r = 0; r < n; r++) {
            duet_shard_t s;
            cr_assert_eq(duet_shard_make(&c, cp, tp, r, &s), DUET_OK, "%s", duet_error_last());
            cr_assert_eq(s.rank, r);
            cr_assert_eq(s.c * tp + s.t, r, "rank = c * tp + t");
            cr_assert_eq(s.kda_h0, kda, "KDA heads continue where rank %d's ended", r - 1);
            cr_assert_eq(s.mlp_i0, mlp);
            cr_assert_eq(s.shr_i0, shr);
            cr_assert_eq(s.exp_e0, exp);
            kda = s.kda_h1, mlp = s.mlp_i1, shr = s.shr_i1, exp = s.exp_e1;
            cr_assert(s.att_h0 < s.att_h1, "every rank attends with a head");
            cr_assert(s.own_h0 >= s.att_h0 && s.own_h1 <= s.att_h1, "owned heads are attended");
            for (int64_t h = s.own_h0; h < s.own_h1; h++)
                own[h]++;
        }
        cr_assert_eq(kda, c.kda_heads);
        cr_assert_eq(mlp, c.dense_intermediate);
        cr_assert_eq(shr, c.moe_intermediate * c.n_shared_experts);
        cr_assert_eq(exp, c.n_experts);
        for (int64_t h = 0; h < c.mla_heads; h++)
            cr_assert_eq(own[h], 1, "cp %d tp %d: MLA head %lld owned %lld times", cp, tp,
                         (long long)h, (long long)own[h]);
    }
}

Test(engine_shard, pages_and_tokens_are_the_dealt_ones)
{
    /* deal pages j -> c = j % cp by hand and count */
    for (int cp = 1; cp <= 5; cp++)
        for (int c = 0; c < cp; c++)
            for (int64_t P = 1; P <= 5; P += 2)
                for (int64_t pos = 0; pos < 40; pos++) {
                    int64_t want = 0;
                    for (int64_t p = 0; p <= pos; p++)
                        want += (p / P) % cp == c;
                    const duet_cpu_mla_shard_t sh = {.cp = cp, .c = c, .page_tokens = P};
                    cr_assert_eq(duet_cpu_mla_local_len(&sh, pos + 1), want,
                                 "cp %d c %d P %lld pos %lld", cp, c, (long long)P, (long long)pos);
                    const int64_t g = pos + 1; /* global pages */
                    int64_t pages = 0;
                    for (int64_t j = 0; j < g; j++)
                        pages += j % cp == c;
                    duet_shard_t s = {.cp = cp, .c = c};
                    cr_assert_eq(duet_shard_local_pages(&s, g), pages);
                }
}

Test(engine_shard, a_ranks_weights_are_its_cut_of_the_checkpoint)
{
    duet_model_config_t c = demo_cfg();
    duet_checkpoint_t *ck = NULL;
    duet_weights_t w, lw;
    cr_assert_eq(duet_checkpoint_open(DEMO, &ck), DUET_OK);
    cr_assert_eq(duet_weights_bind(ck, &c, &w), DUET_OK, "%s", duet_error_last());
    duet_shard_t s;
    cr_assert_eq(duet_shard_make(&c, 2, 2, 3, &s), DUET_OK); /* c 1, t 1 */
    cr_assert_eq(duet_shard_weights(&c, &w, &s, &lw), DUET_OK, "%s", duet_error_last());
    const int64_t K = c.kda_head_dim, D = c.hidden_size, dv = c.v_head_dim;
    const size_t es = duet_dtype_size(w.embed_tokens.dtype);
    for (int64_t l = 0; l < c.num_layers; l++) {
        const duet_layer_weights_t *a = &w.layers[l], *b = &lw.layers[l];
        if (c.mixer[l] == DUET_MIXER_KDA) {
            cr_assert_eq(b->kda.q_proj.shape[0], (s.kda_h1 - s.kda_h0) * K);
            cr_assert_eq(memcmp(b->kda.q_proj.data,
                                (const uint8_t *)a->kda.q_proj.data + s.kda_h0 * K * D * es,
                                (size_t)(K * D) * es),
                         0, "layer %lld: q_proj rows of the rank's heads", (long long)l);
            /* o_proj: columns of the rank's heads, row by row */
            const int64_t hk = c.kda_heads * K, n = (s.kda_h1 - s.kda_h0) * K;
            cr_assert_eq(b->kda.o_proj.shape[1], n);
            for (int64_t r = 0; r < D; r++)
                cr_assert_eq(
                    memcmp((const uint8_t *)b->kda.o_proj.data + r * n * es,
                           (const uint8_t *)a->kda.o_proj.data + (r * hk + s.kda_h0 * K) * es,
                           (size_t)n * es),
                    0);
        } else {
            const int64_t no = s.own_h1 - s.own_h0, ld = c.mla_heads * dv;
            cr_assert_eq(b->mla.o_proj.shape[1], no * dv);
            for (int64_t r = 0; r < D; r++)
                cr_assert_eq(
                    memcmp((const uint8_t *)b->mla.o_proj.data + r * no * dv * es,
                           (const uint8_t *)a->mla.o_proj.data + (r * ld + s.own_h0 * dv) * es,
                           (size_t)(no * dv) * es),
                    0);
        }
        if (c.ffn[l] == DUET_FFN_MOE)
            for (int64_t e = 0; e < c.n_experts; e++)
                cr_assert_eq(b->moe.w1[e].data != NULL, e >= s.exp_e0 && e < s.exp_e1,
                             "expert %lld held only by its rank", (long long)e);
    }
    cr_assert_null(lw.lm_head.data, "only rank 0 holds the LM head");
    duet_weights_free(&lw);
    duet_weights_free(&w);
    duet_checkpoint_close(ck);
}

Test(engine_shard, bad_groups_are_refused)
{
    const duet_model_config_t c = demo_cfg(); /* 4 KDA heads, 4 MLA heads */
    duet_shard_t s;
    cr_assert_eq(duet_shard_make(&c, 0, 1, 0, &s), DUET_ERR_INVALID);
    cr_assert_eq(duet_shard_make(&c, 2, 1, 2, &s), DUET_ERR_INVALID, "rank outside the group");
    cr_assert_eq(duet_shard_make(&c, 3, 1, 0, &s), DUET_ERR_INVALID,
                 "KDA heads that do not divide evenly");
    cr_assert_eq(duet_shard_make(&c, 1, 5, 0, &s), DUET_ERR_INVALID, "tp above the MLA heads");
    cr_assert_eq(duet_shard_make(&c, 65, 1, 0, &s), DUET_ERR_INVALID);
    /* the model refuses a group its communicator does not match */
    duet_comm_t *self = NULL;
    cr_assert_eq(duet_comm_self_create(&self), DUET_OK);
    duet_model_opts_t o;
    duet_model_opts_default(&o);
    o.n_threads = 1;
    o.comm = self;
    o.helix_cp = 2;
    duet_model_t *m = NULL;
    cr_assert_eq(duet_model_load(DEMO, &o, &m), DUET_ERR_INVALID);
    cr_assert(strstr(duet_error_last(), "communicator") != NULL, "%s", duet_error_last());
    duet_comm_destroy(self);
}
