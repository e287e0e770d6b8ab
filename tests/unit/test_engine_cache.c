/*
 * Cache pools: the byte layout documented in engine/cache.h (the transfer layer moves exactly
 * these bytes), all-or-nothing page allocation, slot zeroing, and free counts returning to full.
 */
#include <criterion/criterion.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common/status.h"
#include "engine/cache.h"

Test(engine_cache, kv_layout_and_allocation, .timeout = 30)
{
    duet_kv_pool_desc_t d = {
        .page_tokens = 16, .n_pages = 10, .n_layers = 3, .token_dim = 24, .dtype = DUET_DTYPE_F32};
    duet_kv_pool_t *p = NULL;
    cr_assert_eq(duet_kv_pool_create(&d, &p), DUET_OK);
    const size_t tb = 24 * 4;
    cr_expect_eq(duet_kv_pool_block_bytes(p), 16 * tb);
    cr_expect_geq(duet_kv_pool_bytes(p), 10 * 3 * 16 * tb);
    uint8_t *base = duet_kv_pool_base(p);
    for (int32_t pg = 0; pg < 10; pg++)
        for (int64_t l = 0; l < 3; l++)
            cr_expect_eq((uint8_t *)duet_kv_pool_block(p, pg, l) - base,
                         (ptrdiff_t)(((size_t)pg * 3 + (size_t)l) * 16 * tb));

    int32_t a[10], b[10];
    cr_expect_eq(duet_kv_pool_alloc(p, 4, a), DUET_OK);
    cr_expect_eq(duet_kv_pool_n_free(p), 6);
    cr_expect_eq(duet_kv_pool_alloc(p, 7, b), DUET_ERR_NO_SPACE, "all or nothing");
    cr_expect_eq(duet_kv_pool_n_free(p), 6, "a refused allocation takes nothing");
    cr_expect_eq(duet_kv_pool_alloc(p, 6, b), DUET_OK);
    /* ten distinct pages */
    uint8_t seen[10] = {0};
    for (int i = 0; i < 4; i++)
        seen[a[i]]++;
    for (int i = 0; i < 6; i++)
        seen[b[i]]++;
    for (int i = 0; i < 10; i++)
        cr_expect_eq(seen[i], 1, "page %d handed out %d times", i, seen[i]);
    duet_kv_pool_free(p, a, 4);
    duet_kv_pool_free(p, b, 6);
    cr_expect_eq(duet_kv_pool_n_free(p), 10);
    duet_kv_pool_destroy(p);
    duet_kv_pool_destroy(NULL);
}

Test(engine_cache, kda_layout_and_zeroed_slots, .timeout = 30)
{
    duet_kda_pool_desc_t d = {
        .n_slots = 3, .n_layers = 2, .heads = 2, .head_dim = 8, .conv_kernel = 4};
    duet_kda_pool_t *p = NULL;
    cr_assert_eq(duet_kda_pool_create(&d, &p), DUET_OK);
    const size_t lb = (size_t)(2 * 8 * 8 + 3 * 2 * 8 * 3) * 4;
    cr_expect_eq(duet_kda_pool_layer_bytes(p), lb);
    uint8_t *base = duet_kda_pool_base(p);
    for (int32_t s = 0; s < 3; s++)
        for (int64_t l = 0; l < 2; l++) {
            cr_expect_eq((uint8_t *)duet_kda_pool_state(p, s, l) - base,
                         (ptrdiff_t)(((size_t)s * 2 + (size_t)l) * lb));
            cr_expect_eq(duet_kda_pool_conv(p, s, l) - duet_kda_pool_state(p, s, l), 2 * 8 * 8);
        }
    int32_t s0, s1, s2, s3;
    cr_assert_eq(duet_kda_pool_alloc(p, &s0), DUET_OK);
    memset(duet_kda_pool_state(p, s0, 0), 0x7f, lb * 2); /* dirty the slot */
    cr_assert_eq(duet_kda_pool_alloc(p, &s1), DUET_OK);
    cr_assert_eq(duet_kda_pool_alloc(p, &s2), DUET_OK);
    cr_expect_eq(duet_kda_pool_alloc(p, &s3), DUET_ERR_NO_SPACE);
    duet_kda_pool_free(p, s0);
    cr_assert_eq(duet_kda_pool_alloc(p, &s3), DUET_OK);
    cr_expect_eq(s3, s0, "the freed slot is reused");
    const uint8_t *st = (const uint8_t *)duet_kda_pool_state(p, s3, 0);
    for (size_t i = 0; i < lb * 2; i++)
        cr_assert_eq(st[i], 0, "a reused slot starts zeroed (byte %zu)", i);
    duet_kda_pool_free(p, s1);
    duet_kda_pool_free(p, s2);
    duet_kda_pool_free(p, s3);
    cr_expect_eq(duet_kda_pool_n_free(p), 3);
    duet_kda_pool_destroy(p);
}

Test(engine_cache, bad_descriptors_are_refused, .timeout = 30)
{
    duet_kv_pool_desc_t d = {.page_tokens = 0, .n_pages = 1, .n_layers = 1, .token_dim = 1};
    duet_kv_pool_t *p = NULL;
    cr_expect_eq(duet_kv_pool_create(&d, &p), DUET_ERR_INVALID);
    d.page_tokens = 4;
    d.n_pages = 0;
    cr_expect_eq(duet_kv_pool_create(&d, &p), DUET_ERR_INVALID);
    duet_kda_pool_desc_t k = {
        .n_slots = 1, .n_layers = 1, .heads = 0, .head_dim = 4, .conv_kernel = 4};
    duet_kda_pool_t *q = NULL;
    cr_expect_eq(duet_kda_pool_create(&k, &q), DUET_ERR_INVALID);
}

/* A descriptor whose pool would not fit in 64-bit sizes is refused before anything is allocated
 * (the sizes come from common/cache_layout.h's checked arithmetic). */
Test(engine_cache, overflowing_descriptors_are_refused, .timeout = 30)
{
    duet_kv_pool_desc_t d = {.page_tokens = (int64_t)1 << 40,
                             .n_pages = (int64_t)1 << 20,
                             .n_layers = 4,
                             .token_dim = 1024,
                             .dtype = DUET_DTYPE_F32};
    duet_kv_pool_t *p = NULL;
    cr_expect_eq(duet_kv_pool_bytes_needed(&d), SIZE_MAX);
    cr_expect_eq(duet_kv_pool_create(&d, &p), DUET_ERR_INVALID);
    cr_expect_null(p);
    cr_expect_not_null(strstr(duet_error_last(), "overflow"), "%s", duet_error_last());
    duet_kda_pool_desc_t k = {.n_slots = (int64_t)1 << 30,
                              .n_layers = 64,
                              .heads = (int64_t)1 << 20,
                              .head_dim = 1 << 12,
                              .conv_kernel = 4};
    duet_kda_pool_t *q = NULL;
    cr_expect_eq(duet_kda_pool_bytes_needed(&k), SIZE_MAX);
    cr_expect_eq(duet_kda_pool_create(&k, &q), DUET_ERR_INVALID);
    cr_expect_null(q);
    cr_expect_not_null(strstr(duet_error_last(), "overflow"), "%s", duet_error_last());
}

/* A pool reports the layout its descriptor implies (what the CPU kernels and the transfer plan
 * address it with). */
Test(engine_cache, pools_report_their_layout, .timeout = 30)
{
    duet_kv_pool_desc_t d = {
        .page_tokens = 16, .n_pages = 3, .n_layers = 2, .token_dim = 24, .dtype = DUET_DTYPE_BF16};
    duet_kv_pool_t *p = NULL;
    cr_assert_eq(duet_kv_pool_create(&d, &p), DUET_OK);
    duet_kv_layout_t kl = duet_kv_pool_layout(p);
    cr_expect(kl.page_tokens == 16 && kl.n_layers == 2 && kl.token_bytes == 24 * 2);
    duet_kv_pool_destroy(p);
    duet_kda_pool_desc_t k = {
        .n_slots = 2, .n_layers = 3, .heads = 2, .head_dim = 8, .conv_kernel = 4};
    duet_kda_pool_t *q = NULL;
    cr_assert_eq(duet_kda_pool_create(&k, &q), DUET_OK);
    duet_kda_layout_t sl = duet_kda_pool_layout(q);
    cr_expect(sl.n_layers == 3 && sl.heads == 2 && sl.head_dim == 8 && sl.conv_kernel == 4 &&
              sl.elem_bytes == 4);
    duet_kda_pool_destroy(q);
}

/* The replay pool: rows addressed by (KDA slot, layer, row) as common/cache_layout.h says, in one
 * allocation; bad and overflowing descriptors refused. */
Test(engine_cache, replay_pool_layout, .timeout = 30)
{
    duet_replay_pool_desc_t d = {.n_slots = 3, .n_layers = 2, .heads = 2, .head_dim = 8, .rows = 5};
    duet_replay_pool_t *p = NULL;
    cr_assert_eq(duet_replay_pool_create(&d, &p), DUET_OK, "%s", duet_error_last());
    const size_t rb = (size_t)(6 * 2 * 8 + 2) * 4;
    cr_expect_eq(duet_replay_pool_bytes(p), rb * 5 * 2 * 3);
    cr_expect_eq(duet_replay_pool_bytes_needed(&d), rb * 5 * 2 * 3);
    uint8_t *base = duet_replay_pool_base(p);
    for (int32_t s = 0; s < 3; s++)
        for (int64_t l = 0; l < 2; l++)
            for (int64_t r = 0; r < 5; r++)
                cr_expect_eq((uint8_t *)duet_replay_pool_row(p, s, l, r) - base,
                             (ptrdiff_t)((((size_t)s * 2 + (size_t)l) * 5 + (size_t)r) * rb));
    duet_replay_layout_t l = duet_replay_pool_layout(p);
    cr_expect(l.n_layers == 2 && l.heads == 2 && l.head_dim == 8 && l.rows == 5 &&
              l.elem_bytes == 4);
    /* every byte is writable (the whole allocation is there) */
    memset(base, 0x5a, duet_replay_pool_bytes(p));
    duet_replay_pool_destroy(p);
    duet_replay_pool_destroy(NULL);

    /* caller memory (a UCX segment that receives a moved request's rows): used as it is, rows
     * at the same offsets, and left to the caller by destroy */
    const size_t need = duet_replay_pool_bytes_needed(&d);
    /* a byte past the pool to watch; aligned_alloc takes whole multiples of the alignment */
    const size_t cap = (need + 1 + 63) / 64 * 64;
    uint8_t *mem = aligned_alloc(64, cap);
    cr_assert_not_null(mem);
    memset(mem, 0, cap);
    mem[need] = 0x77;
    duet_replay_pool_desc_t dm = d;
    dm.mem = mem;
    cr_assert_eq(duet_replay_pool_create(&dm, &p), DUET_OK, "%s", duet_error_last());
    cr_expect(duet_replay_pool_base(p) == mem && duet_replay_pool_bytes(p) == need);
    cr_expect_eq((uint8_t *)duet_replay_pool_row(p, 2, 1, 4) - mem,
                 (ptrdiff_t)(((2 * 2 + 1) * 5 + 4) * rb));
    memset(duet_replay_pool_row(p, 2, 1, 4), 0x11, rb); /* the last row ends at `need` */
    duet_replay_pool_destroy(p);
    cr_expect_eq(mem[need - 1], 0x11);
    cr_expect_eq(mem[need], 0x77, "a row past the pool was written");
    free(mem); /* still ours: destroy did not unmap it */

    const duet_replay_pool_desc_t bad[] = {
        {.n_slots = 0, .n_layers = 2, .heads = 2, .head_dim = 8, .rows = 5},
        {.n_slots = 3, .n_layers = 0, .heads = 2, .head_dim = 8, .rows = 5},
        {.n_slots = 3, .n_layers = 2, .heads = 0, .head_dim = 8, .rows = 5},
        {.n_slots = 3, .n_layers = 2, .heads = 2, .head_dim = 8, .rows = 0},
        {.n_slots = 3, .n_layers = 2, .heads = 2, .head_dim = -8, .rows = 5},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        p = NULL;
        cr_expect_eq(duet_replay_pool_create(&bad[i], &p), DUET_ERR_INVALID, "descriptor %zu", i);
        cr_expect_null(p);
        cr_expect_not_null(strstr(duet_error_last(), "bad descriptor"), "%s", duet_error_last());
    }
    duet_replay_pool_desc_t big = {
        .n_slots = 64, .n_layers = 20, .heads = 32, .head_dim = 128, .rows = (int64_t)1 << 50};
    cr_expect_eq(duet_replay_pool_bytes_needed(&big), SIZE_MAX);
    p = NULL;
    cr_expect_eq(duet_replay_pool_create(&big, &p), DUET_ERR_INVALID);
    cr_expect_null(p);
    cr_expect_not_null(strstr(duet_error_last(), "overflow"), "%s", duet_error_last());
}

Test(engine_cache, double_free_is_an_invariant_violation, .signal = SIGABRT, .timeout = 30)
{
    duet_kv_pool_desc_t d = {
        .page_tokens = 4, .n_pages = 2, .n_layers = 1, .token_dim = 4, .dtype = DUET_DTYPE_F32};
    duet_kv_pool_t *p = NULL;
    cr_assert_eq(duet_kv_pool_create(&d, &p), DUET_OK);
    int32_t pg;
    cr_assert_eq(duet_kv_pool_alloc(p, 1, &pg), DUET_OK);
    duet_kv_pool_free(p, &pg, 1);
    duet_kv_pool_free(p, &pg, 1); /* aborts */
}
