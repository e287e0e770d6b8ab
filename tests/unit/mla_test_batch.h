/*
 * mla_test_batch.h: a step of MLA items for the attention tests (test_cuda_mla.c,
 * test_cuda_mla_x.c): per item, positions already cached and new rows; the items' pages are
 * drawn from one pool of ids in a shuffled order (an item's pages neither contiguous nor in
 * order) with spare pages no item owns, and the step's metadata goes to the device as a
 * duet_cuda_step_t. Header-only; include after cuda_test_util.h (rng_u32, xmalloc, dev_copy).
 */
#ifndef DUET_TESTS_MLA_TEST_BATCH_H
#define DUET_TESTS_MLA_TEST_BATCH_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_step.h"
#include "kernels/splitkv.h"

typedef struct {
    int pos0, n_tok; /* tokens already cached, new tokens this step */
} item_spec_t;

typedef struct {
    /* host */
    int n_items, n_rows, max_pages, n_pages, max_ctx;
    int32_t *item_row0, *item_pos0, *item_slot, *item_pages, *row_item, *row_pos;
    /* device */
    duet_cuda_step_t st;
    void *d_arrays[6];
} batch_t;

static void batch_build(batch_t *b, const item_spec_t *items, int n_items, int pt)
{
    memset(b, 0, sizeof(*b));
    b->n_items = n_items;
    b->item_row0 = xmalloc(sizeof(int32_t) * (size_t)(n_items + 1));
    b->item_pos0 = xmalloc(sizeof(int32_t) * (size_t)n_items);
    b->item_slot = xmalloc(sizeof(int32_t) * (size_t)n_items);
    int rows = 0, pages = 0, maxp = 0;
    for (int i = 0; i < n_items; i++) {
        b->item_row0[i] = rows;
        b->item_pos0[i] = items[i].pos0;
        b->item_slot[i] = i;
        rows += items[i].n_tok;
        const int ctx = items[i].pos0 + items[i].n_tok, np = (ctx + pt - 1) / pt;
        pages += np;
        maxp = np > maxp ? np : maxp;
        b->max_ctx = ctx > b->max_ctx ? ctx : b->max_ctx;
    }
    b->item_row0[n_items] = rows;
    b->n_rows = rows;
    b->max_pages = maxp + 1; /* a row stride wider than any item's page count */
    b->n_pages = pages + 3;  /* spare pages that no item owns */

    /* shuffled page ids: item pages are scattered over the pool, in no order */
    int *perm = xmalloc(sizeof(int) * (size_t)b->n_pages);
    for (int i = 0; i < b->n_pages; i++)
        perm[i] = i;
    for (int i = b->n_pages - 1; i > 0; i--) {
        const int j = (int)(rng_u32() % (uint32_t)(i + 1)), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    b->item_pages = xmalloc(sizeof(int32_t) * (size_t)(n_items * b->max_pages));
    for (int i = 0; i < n_items * b->max_pages; i++)
        b->item_pages[i] = -1; /* never read: a stray read would fault */
    int next = 0;
    for (int i = 0; i < n_items; i++) {
        const int ctx = items[i].pos0 + items[i].n_tok;
        for (int p = 0; p < (ctx + pt - 1) / pt; p++)
            b->item_pages[i * b->max_pages + p] = perm[next++];
    }
    free(perm);

    b->row_item = xmalloc(sizeof(int32_t) * (size_t)rows);
    b->row_pos = xmalloc(sizeof(int32_t) * (size_t)rows);
    for (int i = 0; i < n_items; i++)
        for (int t = 0; t < items[i].n_tok; t++) {
            b->row_item[b->item_row0[i] + t] = i;
            b->row_pos[b->item_row0[i] + t] = items[i].pos0 + t;
        }
}

/* The step's device copy; max_split_rows lets every item the planner may split be split (the
 * most rows of an item of at most DUET_SPLITKV_MAX_ROWS). */
static void batch_upload(batch_t *b, int max_item_tokens)
{
    int split_rows = 0;
    for (int i = 0; i < b->n_items; i++) {
        const int rows = b->item_row0[i + 1] - b->item_row0[i];
        if (rows <= DUET_SPLITKV_MAX_ROWS && rows > split_rows)
            split_rows = rows;
    }
    b->d_arrays[0] = dev_copy(b->item_row0, sizeof(int32_t) * (size_t)(b->n_items + 1));
    b->d_arrays[1] = dev_copy(b->item_pos0, sizeof(int32_t) * (size_t)b->n_items);
    b->d_arrays[2] = dev_copy(b->item_slot, sizeof(int32_t) * (size_t)b->n_items);
    b->d_arrays[3] = dev_copy(b->item_pages, sizeof(int32_t) * (size_t)(b->n_items * b->max_pages));
    b->d_arrays[4] = dev_copy(b->row_item, sizeof(int32_t) * (size_t)b->n_rows);
    b->d_arrays[5] = dev_copy(b->row_pos, sizeof(int32_t) * (size_t)b->n_rows);
    b->st = (duet_cuda_step_t){.n_items = b->n_items,
                               .n_rows = b->n_rows,
                               .max_item_tokens = max_item_tokens,
                               .max_split_rows = split_rows,
                               .item_row0 = b->d_arrays[0],
                               .item_pos0 = b->d_arrays[1],
                               .item_slot = b->d_arrays[2],
                               .item_pages = b->d_arrays[3],
                               .max_pages = b->max_pages,
                               .row_item = b->d_arrays[4],
                               .row_pos = b->d_arrays[5]};
}

static void batch_free(batch_t *b)
{
    for (int i = 0; i < 6; i++)
        cudaFree(b->d_arrays[i]);
    free(b->item_row0);
    free(b->item_pos0);
    free(b->item_slot);
    free(b->item_pages);
    free(b->row_item);
    free(b->row_pos);
}

#endif
