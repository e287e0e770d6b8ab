/*
 * Cache pools: one aligned allocation each, free lists as stacks of ids. See cache.h for the
 * byte layout, which the transfer layer relies on.
 */
#include "engine/cache.h"

#include <stdlib.h>
#include <string.h>

#include "common/log.h"

#define DUET_CACHE_ALIGN 4096

struct duet_kv_pool {
    duet_kv_pool_desc_t desc;
    uint8_t            *base;       /* owned, aligned */
    size_t              bytes;
    size_t              block_bytes;
    int32_t            *free_stack; /* owned, [n_pages] */
    int64_t             n_free;
    uint8_t            *is_free;    /* owned, [n_pages] */
};

struct duet_kda_pool {
    duet_kda_pool_desc_t desc;
    uint8_t             *base; /* owned, aligned */
    size_t               bytes;
    size_t               layer_bytes;
    size_t               slot_bytes;
    int32_t             *free_stack;
    int64_t              n_free;
    uint8_t             *is_free;
};

static void *duet__cache_alloc(size_t bytes)
{
    void *p = NULL;
    size_t rounded = (bytes + DUET_CACHE_ALIGN - 1) / DUET_CACHE_ALIGN * DUET_CACHE_ALIGN;
    if (rounded == 0 || posix_memalign(&p, DUET_CACHE_ALIGN, rounded) != 0)
        return NULL;
    memset(p, 0, rounded);
    return p;
}

duet_status_t duet_kv_pool_create(const duet_kv_pool_desc_t *desc, duet_kv_pool_t **pool_p)
{
    if (desc->page_tokens <= 0 || desc->n_pages <= 0 || desc->n_pages > INT32_MAX ||
        desc->n_layers < 0 || desc->token_dim <= 0)
        return DUET_FAIL(DUET_ERR_INVALID, "kv pool: bad descriptor (page_tokens %lld, pages %lld, "
                         "layers %lld, token_dim %lld)", (long long)desc->page_tokens,
                         (long long)desc->n_pages, (long long)desc->n_layers,
                         (long long)desc->token_dim);
    duet_kv_pool_t *pool = calloc(1, sizeof(*pool));
    if (pool == NULL)
        goto err_nomem;
    pool->desc        = *desc;
    pool->block_bytes = (size_t)desc->page_tokens * (size_t)desc->token_dim * duet_dtype_size(desc->dtype);
    pool->bytes       = pool->block_bytes * (size_t)desc->n_pages * (size_t)(desc->n_layers > 0 ? desc->n_layers : 1);
    pool->base        = duet__cache_alloc(pool->bytes);
    if (pool->base == NULL)
        goto err_free_pool;
    pool->free_stack = malloc(sizeof(*pool->free_stack) * (size_t)desc->n_pages);
    pool->is_free    = malloc((size_t)desc->n_pages);
    if (pool->free_stack == NULL || pool->is_free == NULL)
        goto err_free_lists;
    /* Stack top = page 0, so a fresh pool hands out pages in increasing order. */
    for (int64_t i = 0; i < desc->n_pages; i++)
        pool->free_stack[i] = (int32_t)(desc->n_pages - 1 - i);
    memset(pool->is_free, 1, (size_t)desc->n_pages);
    pool->n_free = desc->n_pages;
    *pool_p      = pool;
    return DUET_OK;

err_free_lists:
    free(pool->free_stack);
    free(pool->is_free);
    free(pool->base);
err_free_pool:
    free(pool);
err_nomem:
    return DUET_FAIL(DUET_ERR_NOMEM, "kv pool: cannot allocate %lld pages",
                     (long long)desc->n_pages);
}

void duet_kv_pool_destroy(duet_kv_pool_t *pool)
{
    if (pool == NULL)
        return;
    free(pool->free_stack);
    free(pool->is_free);
    free(pool->base);
    free(pool);
}

const duet_kv_pool_desc_t *duet_kv_pool_desc(const duet_kv_pool_t *pool)
{
    return &pool->desc;
}

duet_status_t duet_kv_pool_alloc(duet_kv_pool_t *pool, int64_t n, int32_t *pages_out)
{
    if (n < 0)
        return duet_error_set(DUET_ERR_INVALID, "kv pool: negative page count");
    if (n > pool->n_free)
        return duet_error_set(DUET_ERR_NO_SPACE, "kv pool: %lld pages wanted, %lld free",
                              (long long)n, (long long)pool->n_free);
    for (int64_t i = 0; i < n; i++) {
        int32_t p = pool->free_stack[--pool->n_free];
        DUET_ASSERT(pool->is_free[p]);
        pool->is_free[p] = 0;
        pages_out[i]     = p;
    }
    return DUET_OK;
}

void duet_kv_pool_free(duet_kv_pool_t *pool, const int32_t *pages, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        int32_t p = pages[i];
        DUET_ASSERT(p >= 0 && p < pool->desc.n_pages);
        DUET_ASSERT(!pool->is_free[p]);
        pool->is_free[p]                  = 1;
        pool->free_stack[pool->n_free++] = p;
    }
}

int64_t duet_kv_pool_n_free(const duet_kv_pool_t *pool)
{
    return pool->n_free;
}

void *duet_kv_pool_base(const duet_kv_pool_t *pool)
{
    return pool->base;
}

size_t duet_kv_pool_bytes(const duet_kv_pool_t *pool)
{
    return pool->bytes;
}

size_t duet_kv_pool_block_bytes(const duet_kv_pool_t *pool)
{
    return pool->block_bytes;
}

void *duet_kv_pool_block(const duet_kv_pool_t *pool, int32_t page, int64_t layer)
{
    DUET_ASSERT(page >= 0 && page < pool->desc.n_pages);
    DUET_ASSERT(layer >= 0 && layer < pool->desc.n_layers);
    return pool->base + ((size_t)page * (size_t)pool->desc.n_layers + (size_t)layer) * pool->block_bytes;
}

duet_status_t duet_kda_pool_create(const duet_kda_pool_desc_t *desc, duet_kda_pool_t **pool_p)
{
    if (desc->n_slots <= 0 || desc->n_slots > INT32_MAX || desc->n_layers < 0 ||
        desc->heads <= 0 || desc->head_dim <= 0 || desc->conv_kernel < 1)
        return DUET_FAIL(DUET_ERR_INVALID, "kda pool: bad descriptor");
    duet_kda_pool_t *pool = calloc(1, sizeof(*pool));
    if (pool == NULL)
        goto err_nomem;
    int64_t hk        = desc->heads * desc->head_dim;
    pool->desc        = *desc;
    pool->layer_bytes = (size_t)(hk * desc->head_dim + 3 * hk * (desc->conv_kernel - 1)) * sizeof(float);
    pool->slot_bytes  = pool->layer_bytes * (size_t)desc->n_layers;
    pool->bytes       = pool->slot_bytes * (size_t)desc->n_slots;
    pool->base        = duet__cache_alloc(pool->bytes > 0 ? pool->bytes : 1);
    if (pool->base == NULL)
        goto err_free_pool;
    pool->free_stack = malloc(sizeof(*pool->free_stack) * (size_t)desc->n_slots);
    pool->is_free    = malloc((size_t)desc->n_slots);
    if (pool->free_stack == NULL || pool->is_free == NULL)
        goto err_free_lists;
    for (int64_t i = 0; i < desc->n_slots; i++)
        pool->free_stack[i] = (int32_t)(desc->n_slots - 1 - i);
    memset(pool->is_free, 1, (size_t)desc->n_slots);
    pool->n_free = desc->n_slots;
    *pool_p      = pool;
    return DUET_OK;

err_free_lists:
    free(pool->free_stack);
    free(pool->is_free);
    free(pool->base);
err_free_pool:
    free(pool);
err_nomem:
    return DUET_FAIL(DUET_ERR_NOMEM, "kda pool: cannot allocate %lld slots",
                     (long long)desc->n_slots);
}

void duet_kda_pool_destroy(duet_kda_pool_t *pool)
{
    if (pool == NULL)
        return;
    free(pool->free_stack);
    free(pool->is_free);
    free(pool->base);
    free(pool);
}

const duet_kda_pool_desc_t *duet_kda_pool_desc(const duet_kda_pool_t *pool)
{
    return &pool->desc;
}

duet_status_t duet_kda_pool_alloc(duet_kda_pool_t *pool, int32_t *slot_p)
{
    if (pool->n_free == 0)
        return duet_error_set(DUET_ERR_NO_SPACE, "kda pool: no free state slot (%lld in use)",
                              (long long)pool->desc.n_slots);
    int32_t s = pool->free_stack[--pool->n_free];
    DUET_ASSERT(pool->is_free[s]);
    pool->is_free[s] = 0;
    memset(pool->base + (size_t)s * pool->slot_bytes, 0, pool->slot_bytes);
    *slot_p = s;
    return DUET_OK;
}

void duet_kda_pool_free(duet_kda_pool_t *pool, int32_t slot)
{
    DUET_ASSERT(slot >= 0 && slot < pool->desc.n_slots);
    DUET_ASSERT(!pool->is_free[slot]);
    pool->is_free[slot]               = 1;
    pool->free_stack[pool->n_free++] = slot;
}

int64_t duet_kda_pool_n_free(const duet_kda_pool_t *pool)
{
    return pool->n_free;
}

void *duet_kda_pool_base(const duet_kda_pool_t *pool)
{
    return pool->base;
}

size_t duet_kda_pool_bytes(const duet_kda_pool_t *pool)
{
    return pool->bytes;
}

size_t duet_kda_pool_layer_bytes(const duet_kda_pool_t *pool)
{
    return pool->layer_bytes;
}

float *duet_kda_pool_state(const duet_kda_pool_t *pool, int32_t slot, int64_t layer)
{
    DUET_ASSERT(slot >= 0 && slot < pool->desc.n_slots);
    DUET_ASSERT(layer >= 0 && layer < pool->desc.n_layers);
    return (float *)(pool->base + (size_t)slot * pool->slot_bytes + (size_t)layer * pool->layer_bytes);
}

float *duet_kda_pool_conv(const duet_kda_pool_t *pool, int32_t slot, int64_t layer)
{
    const duet_kda_pool_desc_t *d = &pool->desc;
    return duet_kda_pool_state(pool, slot, layer) + d->heads * d->head_dim * d->head_dim;
}
