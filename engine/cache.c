/*
 * Cache pools: one aligned allocation each, free lists as stacks of ids. Sizes and addresses come
 * from common/cache_layout.h, the one definition of the byte layout that the transfer layer and
 * the CPU kernels use too.
 */
#include "engine/cache.h"

#include <stdlib.h>
#include <sys/mman.h>
#include <string.h>

#include "common/log.h"

#define DUET_CACHE_ALIGN 4096

/* A stack of free ids 0..n-1 (top = lowest id on a fresh stack) with a free flag per id, so a
 * double free or a foreign id is caught as a broken invariant. */
typedef struct {
    int32_t *stack;   /* owned, [n] */
    uint8_t *is_free; /* owned, [n] */
    int64_t n;
    int64_t n_free;
} duet__id_stack_t;

static int duet__ids_init(duet__id_stack_t *ids, int64_t n)
{
    ids->stack = malloc(sizeof(*ids->stack) * (size_t)n);
    ids->is_free = malloc((size_t)n);
    if (ids->stack == NULL || ids->is_free == NULL) {
        free(ids->stack);
        free(ids->is_free);
        return -1;
    }
    for (int64_t i = 0; i < n; i++)
        ids->stack[i] = (int32_t)(n - 1 - i);
    memset(ids->is_free, 1, (size_t)n);
    ids->n = n;
    ids->n_free = n;
    return 0;
}

static void duet__ids_destroy(duet__id_stack_t *ids)
{
    free(ids->stack);
    free(ids->is_free);
}

static int32_t duet__ids_take(duet__id_stack_t *ids)
{
    int32_t id = ids->stack[--ids->n_free];
    DUET_ASSERT(ids->is_free[id]);
    ids->is_free[id] = 0;
    return id;
}

static void duet__ids_give(duet__id_stack_t *ids, int32_t id)
{
    DUET_ASSERT(id >= 0 && id < ids->n);
    DUET_ASSERT(!ids->is_free[id]);
    ids->is_free[id] = 1;
    ids->stack[ids->n_free++] = id;
}

/* What every pool is: one allocation of `bytes` (the caller's `mem`, or zeroed, page-aligned
 * memory from the kernel, whose pages are materialised on first touch, so a pool that is only
 * bookkeeping, a CUDA model's host side, costs address space, not memory) carved into `n`
 * blocks handed out by id (n = 0: a pool addressed by another pool's ids hands out nothing). */
typedef struct {
    uint8_t *base; /* aligned; owned unless the descriptor gave the memory */
    size_t bytes;
    bool owned;
    duet__id_stack_t free; /* ids of free blocks (pages, slots) */
} duet__slab_t;

static int duet__slab_init(duet__slab_t *sl, size_t bytes, void *mem, int64_t n)
{
    sl->bytes = bytes;
    sl->owned = mem == NULL;
    if (mem == NULL) {
        mem = mmap(NULL, bytes > 0 ? bytes : 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
        if (mem == MAP_FAILED)
            return -1;
    }
    sl->base = mem;
    if (n > 0 && duet__ids_init(&sl->free, n) != 0) {
        if (sl->owned)
            munmap(sl->base, bytes > 0 ? bytes : 1);
        return -1;
    }
    return 0;
}

static void duet__slab_destroy(duet__slab_t *sl)
{
    duet__ids_destroy(&sl->free);
    if (sl->owned)
        munmap(sl->base, sl->bytes > 0 ? sl->bytes : 1);
}

struct duet_kv_pool {
    duet_kv_pool_desc_t desc;
    duet_kv_layout_t layout;
    duet__slab_t slab; /* blocks = pages */
    size_t block_bytes;
    int32_t *extra; /* [n_pages] holders of each page beyond its first (duet_kv_pool_ref) */
};

struct duet_kda_pool {
    duet_kda_pool_desc_t desc;
    duet_kda_layout_t layout;
    duet__slab_t slab; /* blocks = state slots */
    size_t layer_bytes;
    size_t slot_bytes;
};

struct duet_replay_pool {
    duet_replay_pool_desc_t desc;
    duet_replay_layout_t layout;
    duet__slab_t slab; /* blocks addressed by KDA slot: no ids of its own */
};

duet_kv_layout_t duet_kv_pool_desc_layout(const duet_kv_pool_desc_t *d)
{
    return (duet_kv_layout_t){.page_tokens = (uint64_t)d->page_tokens,
                              .n_layers = (uint64_t)d->n_layers,
                              .token_bytes = (uint64_t)d->token_dim * duet_dtype_size(d->dtype)};
}

duet_kda_layout_t duet_kda_pool_desc_layout(const duet_kda_pool_desc_t *d)
{
    return (duet_kda_layout_t){.n_layers = (uint64_t)d->n_layers,
                               .heads = (uint64_t)d->heads,
                               .head_dim = (uint64_t)d->head_dim,
                               .conv_kernel = (uint64_t)d->conv_kernel,
                               .elem_bytes = sizeof(float)};
}

/* SIZE_MAX when the layout's sizes overflow (the allocation then fails). */
size_t duet_kv_pool_bytes_needed(const duet_kv_pool_desc_t *desc)
{
    duet_kv_layout_t l = duet_kv_pool_desc_layout(desc);
    uint64_t block, r;
    if (!duet_kv_layout_block_bytes(&l, &block) ||
        !duet__layout_mul(block, (uint64_t)desc->n_pages, &r) ||
        !duet__layout_mul(r, (uint64_t)(desc->n_layers > 0 ? desc->n_layers : 1), &r) ||
        r > SIZE_MAX)
        return SIZE_MAX;
    return (size_t)r;
}

size_t duet_kda_pool_bytes_needed(const duet_kda_pool_desc_t *desc)
{
    duet_kda_layout_t l = duet_kda_pool_desc_layout(desc);
    uint64_t slot, r;
    if (!duet_kda_layout_slot_bytes(&l, &slot) ||
        !duet__layout_mul(slot, (uint64_t)desc->n_slots, &r) || r > SIZE_MAX)
        return SIZE_MAX;
    return (size_t)r;
}

duet_status_t duet_kv_pool_create(const duet_kv_pool_desc_t *desc, duet_kv_pool_t **pool_p)
{
    if (desc->page_tokens <= 0 || desc->n_pages <= 0 || desc->n_pages > INT32_MAX ||
        desc->n_layers < 0 || desc->token_dim <= 0)
        return DUET_FAIL(DUET_ERR_INVALID,
                         "kv pool: bad descriptor (page_tokens %lld, pages %lld, "
                         "layers %lld, token_dim %lld)",
                         (long long)desc->page_tokens, (long long)desc->n_pages,
                         (long long)desc->n_layers, (long long)desc->token_dim);
    if (duet_kv_pool_bytes_needed(desc) == SIZE_MAX)
        return DUET_FAIL(DUET_ERR_INVALID,
                         "kv pool: %lld pages of %lld tokens overflow the "
                         "address space",
                         (long long)desc->n_pages, (long long)desc->page_tokens);
    duet_kv_pool_t *pool = calloc(1, sizeof(*pool));
    if (pool == NULL)
        goto err_nomem;
    pool->desc = *desc;
    pool->layout = duet_kv_pool_desc_layout(desc);
    uint64_t block = 0;
    (void)duet_kv_layout_block_bytes(&pool->layout, &block); /* bounded by bytes_needed */
    pool->block_bytes = (size_t)block;
    if ((pool->extra = calloc((size_t)desc->n_pages, sizeof(*pool->extra))) == NULL)
        goto err_free_pool;
    if (duet__slab_init(&pool->slab, duet_kv_pool_bytes_needed(desc), desc->mem, desc->n_pages))
        goto err_free_pool;
    *pool_p = pool;
    return DUET_OK;

err_free_pool:
    free(pool->extra);
    free(pool);
err_nomem:
    return DUET_FAIL(DUET_ERR_NOMEM, "kv pool: cannot allocate %lld pages",
                     (long long)desc->n_pages);
}

void duet_kv_pool_destroy(duet_kv_pool_t *pool)
{
    if (pool == NULL)
        return;
    duet__slab_destroy(&pool->slab);
    free(pool->extra);
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
    if (n > pool->slab.free.n_free)
        return duet_error_set(DUET_ERR_NO_SPACE, "kv pool: %lld pages wanted, %lld free",
                              (long long)n, (long long)pool->slab.free.n_free);
    for (int64_t i = 0; i < n; i++)
        pages_out[i] = duet__ids_take(&pool->slab.free);
    return DUET_OK;
}

void duet_kv_pool_free(duet_kv_pool_t *pool, const int32_t *pages, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        DUET_ASSERT(pages[i] >= 0 && pages[i] < pool->desc.n_pages);
        if (pool->extra[pages[i]] > 0)
            pool->extra[pages[i]]--; /* another holder keeps it */
        else
            duet__ids_give(&pool->slab.free, pages[i]);
    }
}

void duet_kv_pool_ref(duet_kv_pool_t *pool, const int32_t *pages, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        DUET_ASSERT(pages[i] >= 0 && pages[i] < pool->desc.n_pages);
        DUET_ASSERT(!pool->slab.free.is_free[pages[i]]);
        pool->extra[pages[i]]++;
    }
}

int32_t duet_kv_pool_holders(const duet_kv_pool_t *pool, int32_t page)
{
    if (page < 0 || page >= pool->desc.n_pages || pool->slab.free.is_free[page])
        return 0;
    return 1 + pool->extra[page];
}

int64_t duet_kv_pool_n_free(const duet_kv_pool_t *pool)
{
    return pool->slab.free.n_free;
}

void *duet_kv_pool_base(const duet_kv_pool_t *pool)
{
    return pool->slab.base;
}

size_t duet_kv_pool_bytes(const duet_kv_pool_t *pool)
{
    return pool->slab.bytes;
}

size_t duet_kv_pool_block_bytes(const duet_kv_pool_t *pool)
{
    return pool->block_bytes;
}

void *duet_kv_pool_block(const duet_kv_pool_t *pool, int32_t page, int64_t layer)
{
    DUET_ASSERT(page >= 0 && page < pool->desc.n_pages);
    DUET_ASSERT(layer >= 0 && layer < pool->desc.n_layers);
    uint64_t off = 0;
    (void)duet_kv_layout_offset(&pool->layout, (uint64_t)page, (uint64_t)layer, 0, &off);
    return pool->slab.base + off;
}

duet_kv_layout_t duet_kv_pool_layout(const duet_kv_pool_t *pool)
{
    return pool->layout;
}

void duet_kv_pool_zero_pages(duet_kv_pool_t *pool, const int32_t *pages, int64_t n)
{
    for (int64_t p = 0; p < n; p++)
        memset(duet_kv_pool_block(pool, pages[p], 0), 0,
               pool->block_bytes * (size_t)pool->desc.n_layers);
}

duet_status_t duet_kda_pool_create(const duet_kda_pool_desc_t *desc, duet_kda_pool_t **pool_p)
{
    if (desc->n_slots <= 0 || desc->n_slots > INT32_MAX || desc->n_layers < 0 || desc->heads <= 0 ||
        desc->head_dim <= 0 || desc->conv_kernel < 1)
        return DUET_FAIL(DUET_ERR_INVALID, "kda pool: bad descriptor");
    if (duet_kda_pool_bytes_needed(desc) == SIZE_MAX)
        return DUET_FAIL(DUET_ERR_INVALID, "kda pool: %lld slots overflow the address space",
                         (long long)desc->n_slots);
    duet_kda_pool_t *pool = calloc(1, sizeof(*pool));
    if (pool == NULL)
        goto err_nomem;
    pool->desc = *desc;
    pool->layout = duet_kda_pool_desc_layout(desc);
    uint64_t layer = 0;
    (void)duet_kda_layout_layer_bytes(&pool->layout, &layer); /* bounded by bytes_needed */
    pool->layer_bytes = (size_t)layer;
    pool->slot_bytes = pool->layer_bytes * (size_t)desc->n_layers;
    if (duet__slab_init(&pool->slab, duet_kda_pool_bytes_needed(desc), desc->mem, desc->n_slots))
        goto err_free_pool;
    *pool_p = pool;
    return DUET_OK;

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
    duet__slab_destroy(&pool->slab);
    free(pool);
}

const duet_kda_pool_desc_t *duet_kda_pool_desc(const duet_kda_pool_t *pool)
{
    return &pool->desc;
}

duet_status_t duet_kda_pool_alloc(duet_kda_pool_t *pool, int32_t *slot_p)
{
    if (pool->slab.free.n_free == 0)
        return duet_error_set(DUET_ERR_NO_SPACE, "kda pool: no free state slot (%lld in use)",
                              (long long)pool->desc.n_slots);
    int32_t s = duet__ids_take(&pool->slab.free);
    memset(pool->slab.base + (size_t)s * pool->slot_bytes, 0, pool->slot_bytes);
    *slot_p = s;
    return DUET_OK;
}

void duet_kda_pool_free(duet_kda_pool_t *pool, int32_t slot)
{
    duet__ids_give(&pool->slab.free, slot);
}

int64_t duet_kda_pool_n_free(const duet_kda_pool_t *pool)
{
    return pool->slab.free.n_free;
}

void *duet_kda_pool_base(const duet_kda_pool_t *pool)
{
    return pool->slab.base;
}

size_t duet_kda_pool_bytes(const duet_kda_pool_t *pool)
{
    return pool->slab.bytes;
}

size_t duet_kda_pool_layer_bytes(const duet_kda_pool_t *pool)
{
    return pool->layer_bytes;
}

size_t duet_kda_pool_slot_bytes(const duet_kda_pool_t *pool)
{
    return pool->slot_bytes;
}

float *duet_kda_pool_state(const duet_kda_pool_t *pool, int32_t slot, int64_t layer)
{
    DUET_ASSERT(slot >= 0 && slot < pool->desc.n_slots);
    DUET_ASSERT(layer >= 0 && layer < pool->desc.n_layers);
    uint64_t off = 0;
    (void)duet_kda_layout_state_offset(&pool->layout, (uint64_t)slot, (uint64_t)layer, 0, &off);
    return (float *)(pool->slab.base + off);
}

float *duet_kda_pool_conv(const duet_kda_pool_t *pool, int32_t slot, int64_t layer)
{
    DUET_ASSERT(slot >= 0 && slot < pool->desc.n_slots);
    DUET_ASSERT(layer >= 0 && layer < pool->desc.n_layers);
    uint64_t off = 0;
    (void)duet_kda_layout_conv_offset(&pool->layout, (uint64_t)slot, (uint64_t)layer, 0, 0, &off);
    return (float *)(pool->slab.base + off);
}

duet_kda_layout_t duet_kda_pool_layout(const duet_kda_pool_t *pool)
{
    return pool->layout;
}

duet_replay_layout_t duet_replay_pool_desc_layout(const duet_replay_pool_desc_t *d)
{
    return (duet_replay_layout_t){.n_layers = (uint64_t)d->n_layers,
                                  .heads = (uint64_t)d->heads,
                                  .head_dim = (uint64_t)d->head_dim,
                                  .rows = (uint64_t)d->rows,
                                  .elem_bytes = sizeof(float)};
}

size_t duet_replay_pool_bytes_needed(const duet_replay_pool_desc_t *desc)
{
    duet_replay_layout_t l = duet_replay_pool_desc_layout(desc);
    uint64_t slot, r;
    if (!duet_replay_layout_slot_bytes(&l, &slot) ||
        !duet__layout_mul(slot, (uint64_t)desc->n_slots, &r) || r > SIZE_MAX)
        return SIZE_MAX;
    return (size_t)r;
}

duet_status_t duet_replay_pool_create(const duet_replay_pool_desc_t *desc,
                                      duet_replay_pool_t **pool_p)
{
    if (desc->n_slots <= 0 || desc->n_slots > INT32_MAX || desc->n_layers <= 0 ||
        desc->heads <= 0 || desc->head_dim <= 0 || desc->rows <= 0)
        return DUET_FAIL(DUET_ERR_INVALID,
                         "replay pool: bad descriptor (slots %lld, layers %lld, heads %lld, "
                         "head_dim %lld, rows %lld)",
                         (long long)desc->n_slots, (long long)desc->n_layers,
                         (long long)desc->heads, (long long)desc->head_dim, (long long)desc->rows);
    const size_t bytes = duet_replay_pool_bytes_needed(desc);
    if (bytes == SIZE_MAX)
        return DUET_FAIL(DUET_ERR_INVALID,
                         "replay pool: %lld rows of %lld slots overflow the address space",
                         (long long)desc->rows, (long long)desc->n_slots);
    duet_replay_pool_t *pool = calloc(1, sizeof(*pool));
    if (pool == NULL)
        goto err_nomem;
    pool->desc = *desc;
    pool->layout = duet_replay_pool_desc_layout(desc);
    if (duet__slab_init(&pool->slab, bytes, desc->mem, 0))
        goto err_free_pool;
    *pool_p = pool;
    return DUET_OK;

err_free_pool:
    free(pool);
err_nomem:
    return DUET_FAIL(DUET_ERR_NOMEM, "replay pool: cannot allocate %zu bytes (%lld rows)", bytes,
                     (long long)desc->rows);
}

void duet_replay_pool_destroy(duet_replay_pool_t *pool)
{
    if (pool == NULL)
        return;
    duet__slab_destroy(&pool->slab);
    free(pool);
}

const duet_replay_pool_desc_t *duet_replay_pool_desc(const duet_replay_pool_t *pool)
{
    return &pool->desc;
}

void *duet_replay_pool_base(const duet_replay_pool_t *pool)
{
    return pool->slab.base;
}

size_t duet_replay_pool_bytes(const duet_replay_pool_t *pool)
{
    return pool->slab.bytes;
}

float *duet_replay_pool_row(const duet_replay_pool_t *pool, int32_t slot, int64_t layer,
                            int64_t row)
{
    DUET_ASSERT(slot >= 0 && slot < pool->desc.n_slots);
    DUET_ASSERT(layer >= 0 && layer < pool->desc.n_layers);
    DUET_ASSERT(row >= 0 && row < pool->desc.rows);
    uint64_t off = 0;
    (void)duet_replay_layout_row_offset(&pool->layout, (uint64_t)slot, (uint64_t)layer,
                                        (uint64_t)row, &off);
    return (float *)(pool->slab.base + off);
}

duet_replay_layout_t duet_replay_pool_layout(const duet_replay_pool_t *pool)
{
    return pool->layout;
}
